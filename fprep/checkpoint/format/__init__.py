"""The checkpoint format: what the bytes on storage are and how each file is checked.

Raw tensor bytes with DCP's plan as JSON (``storage``, ``metadata``), nested non-tensor state as
plain JSON (``encoding``), the manifest that records every file's size and digest
(``manifest``), and the file primitives under them (``files``). Nothing here knows where a
checkpoint lives or when it is written.
"""
