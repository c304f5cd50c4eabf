"""Every Python example in docs/ runs against the current code (a page may be one script in
several blocks: see CONTINUES), every error message the docs quote is printed by a raise site in
fprep/, the `fprep plan` output shown is what it prints, and links between pages lead somewhere."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest
from _doc_messages import Quote, matches, message_templates, quoted_messages, render

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: A block that starts with this line goes on from the block before it on its page (a page
#: written as one script, docs/finetune.md): the two run in one namespace, in order.
CONTINUES = "# continues the block above"
PAGES = {
    page.name: re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    for page in sorted(DOCS.glob("*.md"))
}
BLOCKS = [(page, i, code) for page, blocks in PAGES.items() for i, code in enumerate(blocks)]


def _chain(page: str, index: int) -> list[int]:
    """The blocks that run together to run block ``index``: it and those it continues."""
    start = index
    while start > 0 and PAGES[page][start].startswith(CONTINUES):
        start -= 1
    return list(range(start, index + 1))


@pytest.mark.parametrize(("page", "index", "code"), BLOCKS, ids=[f"{p}[{i}]" for p, i, _ in BLOCKS])
def test_doc_example_runs(page: str, index: int, code: str) -> None:
    blocks = PAGES[page]
    if index + 1 < len(blocks) and blocks[index + 1].startswith(CONTINUES):
        pytest.skip(f"runs as the start of docs/{page}[python {index + 1}], which continues it")
    chain = _chain(page, index)
    if "import " not in blocks[chain[0]]:
        pytest.skip("an illustration, not a program (no imports)")
    namespace: dict[str, object] = {"__name__": f"docs_{page}_{index}"}
    for i in chain:
        exec(compile(blocks[i], f"docs/{page}[python {i}]", "exec"), namespace)
    for name, value in list(namespace.items()):
        if name.startswith("test_") and callable(value):
            value()


def test_continued_blocks_follow_a_program() -> None:
    """A continuation marker on a page's first block, or after a block without imports (an
    illustration, never run), would silently run less than the page shows."""
    for page, blocks in PAGES.items():
        for i, code in enumerate(blocks):
            if code.startswith(CONTINUES):
                assert i > 0, f"docs/{page}[python 0] continues nothing"
                assert "import " in blocks[_chain(page, i)[0]], f"docs/{page}[python {i}]"


# -- command output shown in docs/ ------------------------------------------------------------
#: A `text` block right after a `bash` block whose first line is one of these commands shows its
#: output (`...` for lines left out); the test runs the command and compares.
OUTPUT_OF = re.compile(r"```bash\n(fprep plan [^\n]*)\n.*?```\s*```text\n(.*?)```", re.S)
OUTPUTS = [
    (page.name, command, shown)
    for page in sorted(DOCS.glob("*.md"))
    for command, shown in OUTPUT_OF.findall(page.read_text())
]


@pytest.mark.parametrize(("page", "command", "shown"), OUTPUTS, ids=[c for _, c, _ in OUTPUTS])
def test_shown_output_is_what_the_command_prints(
    page: str, command: str, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import shlex

    from fprep.cli import main

    assert main(shlex.split(command)[1:]) == 0
    printed = capsys.readouterr().out.splitlines()
    at = 0
    for line in shown.splitlines():
        if line.strip() == "...":
            continue
        assert line in printed[at:], f"docs/{page}: `{command}` no longer prints {line!r}"
        at = printed.index(line, at) + 1


def test_some_output_is_checked() -> None:
    assert any(page == "getting_started.md" for page, _, _ in OUTPUTS)


# -- error messages quoted in docs/ -----------------------------------------------------------
QUOTES = [q for page in sorted(DOCS.glob("*.md")) for q in quoted_messages(page)]


def test_docs_quote_error_messages() -> None:
    # errors.md's tables quote messages; a column renamed away would silently check nothing.
    assert sum(q.page == "errors.md" for q in QUOTES) > 150


@pytest.mark.parametrize("quote", QUOTES, ids=[f"{q.page}:{q.line}" for q in QUOTES])
def test_quoted_error_message_has_a_raise_site(quote: Quote) -> None:
    """Each message quoted in an "example message" column is what a raise site in fprep/ prints
    (the convention is at the top of docs/errors.md)."""
    sites = message_templates()
    forms = [
        t for s in sites for t in (s.templates if quote.with_hint else s.templates + s.messages)
    ]
    if any(matches(t, quote.text) for t in forms):
        return
    rendered = [render(t) for t in forms]
    close = difflib.get_close_matches(quote.text, rendered, n=1, cutoff=0.0)
    pytest.fail(
        f"{quote.where}: no raise site in fprep/ prints the quoted message\n"
        f"  `{quote.text}`\n"
        f"  closest message in the source (… = a value): {close[0] if close else '(none)'}\n"
        "  Copy the message from the code's output (str(error)), with … for values; see the "
        "convention at the top of docs/errors.md.",
        pytrace=False,
    )


def test_message_matching_follows_the_convention() -> None:
    """The matcher itself: literal text must agree, … only where the code inserts a value (or
    at the start or end), and a quote that leaves everything to wildcards matches nothing."""
    t = ("PrepConfig.", None, " must be True or False; got ", None, ".")
    assert matches(t, "PrepConfig.seed must be True or False; got 1.")
    assert matches(t, "PrepConfig.… must be True or False; got ….")
    assert matches(t, "PrepConfig.seed must be True or …")  # the rest left out
    assert matches(t, "… must be True or False; got 1.")  # the start left out
    assert not matches(t, "PrepConfig.seed must be true or false; got 1.")  # drifted wording
    assert not matches(t, "PrepConfig.seed must be … got 1.")  # … only where a value goes
    assert not matches((None, " is not callable."), "anything at all …")


# -- claims the docs make that a test can decide --------------------------------------------
def test_prepared_loader_never_draws_from_the_global_rng() -> None:
    """checkpoints.md and training.md: a plain DataLoader draws its seed from the global RNG at
    every new iterator (so a resumed run needs fork_rng around it); a prepared one never does,
    also when resumed mid-epoch, so no wrapper is needed for an exact resume."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import fprep

    data = TensorDataset(torch.arange(32.0))
    state, _ = fprep.prepare(torch.nn.Linear(1, 1), fprep.PrepConfig())
    prepared = fprep.prepare_data_loader(state, DataLoader(data, batch_size=4, shuffle=True))

    def draws(loader: object, *, resume: bool = False) -> bool:
        before = torch.random.get_rng_state()
        if resume:
            loader.load_state_dict({"epoch": 1, "batches": 3})  # type: ignore[attr-defined]
        next(iter(loader))  # type: ignore[call-overload]
        return not torch.equal(before, torch.random.get_rng_state())

    assert draws(DataLoader(data, batch_size=4, shuffle=True))
    assert not draws(prepared) and not draws(prepared, resume=True)


# -- links between the pages ------------------------------------------------------------------
def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_links_between_pages_lead_somewhere() -> None:
    """Every relative link in docs/ and the README names a page that exists and, with #anchor,
    a heading on it: a newcomer following one never lands nowhere."""
    root = DOCS.parent
    pages = [*sorted(DOCS.glob("*.md")), root / "README.md"]
    broken = []
    for page in pages:
        text = page.read_text()
        for target, anchor in re.findall(r"\]\(([^)#:\s]*\.md)?(?:#([^)\s]+))?\)", text):
            linked = (page.parent / target) if target else page
            if not linked.is_file():
                broken.append(f"{page.name}: {target}")
            elif anchor and anchor not in _anchors(linked.read_text()):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert not broken, broken
