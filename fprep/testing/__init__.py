"""Test support: hypothesis strategies (``fprep.testing.strategies``, needs the ``test`` extra)
and small model builders (``fprep.testing.models``) used by tests, benchmarks and the demo."""
