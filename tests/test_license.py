"""The license pyproject.toml declares is the one the LICENSE file holds, in full."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What a license's full text must hold, by its SPDX identifier: its title and version lines,
#: and the headings of every section of its terms (a stub or a summary lacks them).
FULL_TEXTS = {
    "Apache-2.0": (
        "Apache License",
        "Version 2.0, January 2004",
        "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
        "1. Definitions.",
        "2. Grant of Copyright License.",
        "3. Grant of Patent License.",
        "4. Redistribution.",
        "5. Submission of Contributions.",
        "6. Trademarks.",
        "7. Disclaimer of Warranty.",
        "8. Limitation of Liability.",
        "9. Accepting Warranty or Additional Liability.",
        "END OF TERMS AND CONDITIONS",
    ),
}


def _declared() -> str:
    """pyproject's license: `license = "ID"` (PEP 639) or `license = { text = "ID" }`."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'^license\s*=\s*(?:\{\s*text\s*=\s*)?"([^"]+)"', pyproject, re.M)
    assert found, "pyproject.toml declares no license"
    return found.group(1)


def test_license_file_holds_the_license_pyproject_declares() -> None:
    declared = _declared()
    assert declared in FULL_TEXTS, f"pyproject's license {declared!r}: add its full text check"
    text = (ROOT / "LICENSE").read_text()
    missing = [line for line in FULL_TEXTS[declared] if line not in text]
    assert not missing, f"LICENSE is not the full {declared} text: lacks {missing}"
    # the title and version open the file, as in the license's standard text
    opening = " ".join(FULL_TEXTS[declared][:2]).split()
    assert text.split()[: len(opening)] == opening


def test_no_other_license_text_is_declared() -> None:
    """One license file at the root: a second one (LICENSE.txt, COPYING) would be shipped too."""
    others = [
        p.name
        for p in ROOT.iterdir()
        if p.is_file() and re.match(r"(LICEN[CS]E|COPYING)", p.name) and p.name != "LICENSE"
    ]
    assert not others, others
