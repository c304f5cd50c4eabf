"""``python -m fprep``: the ``fprep`` command line, for environments without the script on PATH."""

from fprep.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
