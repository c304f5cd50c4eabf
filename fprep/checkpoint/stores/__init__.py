"""Where checkpoints live: a local root or an fsspec URL, and how a step is published there.

``backend`` is the seam ``save`` / ``load`` use (``open_store``); ``layout`` and ``lock`` are the
local root (step directories, the ``latest`` pointer, one saver at a time), ``fsspec_store`` the
same contract on object stores, ``sink`` one exported file that appears whole or not at all,
``visible`` the check that the publishing rank sees every rank's files.
"""
