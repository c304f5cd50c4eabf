"""Every Python example in docs/ runs against the current code (a page may be one script in
several blocks: see CONTINUES; finetune.md also under torchrun), every error message the docs
quote is printed by a raise site in fprep/, the `fprep plan` and `fprep demo` output shown is what
they print, the figures and the supported torch range the pages quote are what the code computes
and declares now, and links between pages lead somewhere."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
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
#: output (`...` for lines left out); the test runs the command and compares. (The rest of the
#: `bash` block holds no backtick: the match never runs past its end.)
OUTPUT_OF = re.compile(
    r"```bash\n(fprep (?:plan|demo)(?: [^\n]*)?)\n[^`]*```\s*```text\n(.*?)```", re.S
)
OUTPUTS = [
    (page.name, command, shown)
    for page in sorted(DOCS.glob("*.md"))
    for command, shown in OUTPUT_OF.findall(page.read_text())
]
#: Times in `fprep demo`'s output (per step, padded to a width; in all), which vary from run to
#: run.
TIMES = re.compile(r" +\d+(?:\.\d+)? ms/step|(?<=, )\d+(?:\.\d+)? s$")


def _untimed(line: str) -> str:
    return TIMES.sub("(time)", line)


@pytest.mark.parametrize(
    ("page", "command", "shown"),
    [
        pytest.param(*o, marks=[pytest.mark.slow] if o[1].startswith("fprep demo") else [])
        for o in OUTPUTS
    ],
    ids=[c for _, c, _ in OUTPUTS],
)
def test_shown_output_is_what_the_command_prints(
    page: str, command: str, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import shlex

    from fprep.cli import main

    assert main(shlex.split(command)[1:]) == 0
    printed = [_untimed(line) for line in capsys.readouterr().out.splitlines()]
    at = 0
    for line in map(_untimed, shown.splitlines()):
        if line.strip() == "...":
            continue
        assert line in printed[at:], f"docs/{page}: `{command}` no longer prints {line!r}"
        at = printed.index(line, at) + 1


def test_demo_times_are_all_that_is_left_unchecked() -> None:
    """Only the times are masked: a loss, a step count or a bar in the same line still count."""
    shown = "[####] step 200/200  loss  0.0295    81.7 ms/step"
    assert _untimed(shown) == "[####] step 200/200  loss  0.0295(time)"
    assert _untimed(shown.replace("0.0295", "0.0296")) != _untimed(shown)
    final = "loss fell: 4.2035 (step 1) -> 0.0360 (mean of the last 20 steps), -99.1% in 200 steps"
    final += ", 20.0 s"
    assert _untimed(final).endswith("in 200 steps, (time)")
    assert "4.2035" in _untimed(final) and "0.0360" in _untimed(final)


def test_some_output_is_checked() -> None:
    commands = {(page, command.split()[1]) for page, command, _ in OUTPUTS}
    assert {("getting_started.md", "plan"), ("getting_started.md", "demo")} <= commands
    assert ("parallelism.md", "plan") in commands


# -- a page that is one script, under torchrun ------------------------------------------------
def _script(page: str, containing: str | None = None) -> str:
    """The page's first program (the first containing ``containing``, if given) with every
    block that continues it, as one file."""
    blocks = PAGES[page]
    start = 0 if containing is None else next(i for i, b in enumerate(blocks) if containing in b)
    end = start + 1
    while end < len(blocks) and blocks[end].startswith(CONTINUES):
        end += 1
    return "\n".join(blocks[start:end])


def _torchrun(script: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``script`` run under ``torchrun --standalone --nproc-per-node 2``; it must succeed."""

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.run(
        [*command, "--nproc-per-node", "2", str(script)],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(DOCS.parent), "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_finetune_page_runs_under_torchrun(tmp_path: Path) -> None:
    """finetune.md says its script runs under torchrun as it is, given a directory every rank
    sees: at 2 ranks each rank trains on half the batches, saves, resumes and writes the model
    back for from_pretrained (in one process the test above runs it)."""

    script = tmp_path / "finetune.py"
    script.write_text(_script("finetune.md"))
    shared = tmp_path / "shared"
    shared.mkdir()
    proc = _torchrun(script, tmp_path, FINETUNE_DIR=str(shared))
    assert "rank 0 of 2" in proc.stdout and "step 4: loss" in proc.stdout
    assert "step 5:" not in proc.stdout  # half of the 8 batches per rank
    assert (shared / "finetuned" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_script_runs_under_torchrun(tmp_path: Path) -> None:
    """parallelism.md's pipeline loop at pp 2: the last stage's rank prints the losses, the
    first stage's rank prints nothing (in one process the test above runs it without pp)."""

    script = tmp_path / "pipeline.py"
    script.write_text(_script("parallelism.md", "fprep.pipeline_step"))
    proc = _torchrun(script, tmp_path)
    assert "rank 1 of 2: step 5: loss" in proc.stdout
    assert "rank 0 of 2" not in proc.stdout


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


# -- figures the pages quote, recomputed -----------------------------------------------------
def _llama_405b_figures(tp: int) -> dict[str, str]:
    """What `fprep plan fprep.testing.models:llama_405b --world-size 1024 --nproc-per-node 8
    --tp <tp> --precision bf16` plans for rank 0, as the pages write it (`human_bytes`)."""
    import fprep
    from fprep.summary import human_bytes
    from fprep.testing.models import llama_405b

    cfg = fprep.PrepConfig(strategy="fsdp", tp=tp, wrap=("LlamaBlock",), precision="bf16")
    topology = fprep.Topology(world_size=1024, rank=0, local_world_size=8)
    state = fprep.plan(llama_405b(), cfg, topology).unwrap()
    mem = fprep.estimate_memory(state)
    *blocks, root = state.param_handles.units
    assert root.fqn == "" and all(unit.cls.endswith("LlamaBlock") for unit in blocks)

    def gathered(unit: fprep.WrapUnit) -> int:  # bf16, each parameter's tp block
        return sum(p.gathered_numel * 2 for p in unit.params)

    assert mem.largest_unit_unsharded == gathered(root) > max(map(gathered, blocks))
    assert {gathered(unit) for unit in blocks} == {gathered(blocks[0])}
    head = {p.fqn: p.shape for p in root.params}["output.weight"]
    return {
        "params": human_bytes(mem.params),
        "grads": human_bytes(mem.grads),
        "adam": human_bytes(mem.adam),
        "total": human_bytes(mem.total("adam")),
        "root": human_bytes(gathered(root)),
        "block": human_bytes(gathered(blocks[0])),
        "head": f"{head[0]} x {head[1]}",
    }


def _tiny_gpt_params(world_size: int) -> str:
    """getting_started.md's train.py: this rank's parameter bytes under fsdp at ``world_size``."""
    import fprep
    from fprep.summary import human_bytes
    from fprep.testing.models import GPTBlock, tiny_gpt

    cfg = fprep.PrepConfig(strategy="fsdp", wrap=GPTBlock, seed=0)
    state = fprep.plan(tiny_gpt(seed=0), cfg, fprep.Topology(world_size=world_size)).unwrap()
    return human_bytes(fprep.estimate_memory(state).params)


def _claims() -> list[tuple[str, str]]:
    """(page, sentence) for each figure a page quotes, rendered from what the code computes."""
    tp8, fsdp = _llama_405b_figures(8), _llama_405b_figures(1)
    assert tp8["total"] == fsdp["total"]  # parallelism.md: "the same ... either way"
    half, whole = _tiny_gpt_params(2), _tiny_gpt_params(1)
    return [
        (
            "getting_started.md",
            f"(`this rank params {half}` in the summary, against {whole} alone)",
        ),
        ("parallelism.md", f"the output head ({tp8['head']} each, split over tp)"),
        ("parallelism.md", f"gathers its TP slice of them, {tp8['root']} in bf16."),
        ("parallelism.md", f"A block's TP slice is {tp8['block']}."),
        ("parallelism.md", f"the root gathers whole, {fsdp['root']} in bf16"),
        ("parallelism.md", f"and each block {fsdp['block']}."),
        ("parallelism.md", f"The per-rank total is the same {tp8['total']} either way"),
    ]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_quoted_figures_are_what_the_code_computes() -> None:
    """The plan figures pages quote in prose (the 405B plan's in parallelism.md, train.py's
    shard in getting_started.md; the `fprep plan` output the pages show is compared above, the
    README's in tests/test_pipeline_memory.py): each sentence, rendered from the plan fprep
    makes now."""
    root = DOCS.parent
    stale = []
    for page, sentence in _claims():
        path = root / page if page == "README.md" else DOCS / page
        if _flat(sentence) not in _flat(path.read_text()):
            stale.append(f"{page}: expected {sentence!r}")
    assert not stale, "pages quote figures the code no longer computes:\n" + "\n".join(stale)


def test_every_405b_figure_in_prose_is_a_computed_one() -> None:
    """A paragraph about the 405B plan quotes only figures of that plan (with or without TP): a
    new figure added without a claim above, or a stale one left, fails here."""
    known = {v for tp in (8, 1) for v in _llama_405b_figures(tp).values()}
    root = DOCS.parent
    unknown = []
    for path in [*sorted(DOCS.glob("*.md")), root / "README.md"]:
        prose = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        # paragraphs, and each row of a table on its own (a row is one script's figures)
        units = [
            unit
            for paragraph in prose.split("\n\n")
            for unit in (paragraph.splitlines() if paragraph.startswith("|") else [paragraph])
        ]
        for unit in units:
            if "405B" not in unit and "llama_405b" not in unit:
                continue
            for figure in re.findall(r"\d+(?:\.\d+)? [KMGT]?iB\b", unit):
                if figure not in known:
                    unknown.append(f"{path.name}: {figure}")
    assert not unknown, unknown


# -- the supported torch releases -------------------------------------------------------------
def _supported() -> tuple[str, str, str]:
    """(oldest, newest tested, first unsupported) as `major.minor`, from fprep.compat."""
    from fprep import compat

    lo, hi = compat.MIN_TORCH, compat.NEWEST_TESTED
    return f"{lo[0]}.{lo[1]}", f"{hi[0]}.{hi[1]}", f"{hi[0]}.{hi[1] + 1}"


def test_pyproject_requires_the_supported_torch() -> None:
    lo, _, above = _supported()
    pyproject = (DOCS.parent / "pyproject.toml").read_text()
    assert f'"torch>={lo},<{above}"' in pyproject


def test_pages_state_the_supported_torch_range() -> None:
    """Every "2.x to 2.y" on a page is the supported range (fprep.compat's MIN_TORCH to
    NEWEST_TESTED; other ranges of releases are written out, "2.13, 2.14 and 2.15"), and every
    `torch>=…,<…` is pyproject's. docs/versions.md states it; the other pages must agree."""
    lo, hi, above = _supported()
    major = lo.split(".")[0]
    root = DOCS.parent
    wrong = []
    seen = set()
    for path in [*sorted(DOCS.glob("*.md")), root / "README.md"]:
        text = _flat(path.read_text())
        for first, last in re.findall(rf"\b({major}\.\d+) to ({major}\.\d+)\b", text):
            seen.add(path.name)
            if (first, last) != (lo, hi):
                wrong.append(f"{path.name}: {first} to {last} (supported: {lo} to {hi})")
        for first, last in re.findall(r"torch>=(\d+\.\d+),<(\d+\.\d+)", text):
            if (first, last) != (lo, above):
                wrong.append(f"{path.name}: torch>={first},<{last} (pyproject: >={lo},<{above})")
    assert not wrong, wrong
    assert {"versions.md", "getting_started.md", "README.md"} <= seen


def _ci_subsets() -> dict[str, set[str]]:
    """The torch releases .ci/run installs beside the main one, each with the test files it runs
    there (one `pip install ... torch==X` then one `pytest` command per release)."""
    ci = (DOCS.parent / ".ci" / "run").read_text().replace("\\\n", " ")
    subsets: dict[str, set[str]] = {}
    release = None
    for line in ci.splitlines():
        installed = re.search(r"pip install .*torch==(\S+)", line)
        if installed:
            release = installed.group(1)
        elif release and "pytest" in line and "tests/test_" in line:
            subsets[release] = set(re.findall(r"tests/(test_\w+)\.py", line))
    return subsets


def test_versions_page_lists_what_ci_runs() -> None:
    """docs/versions.md's "Tested where" row of each release CI runs a subset on names every test
    file CI runs there, and the release CI runs the full suite on is the one it says."""
    subsets = _ci_subsets()
    assert len(subsets) >= 2, subsets  # the releases beside the main one
    rows = {
        row.split("|")[1].strip(): row
        for row in (DOCS / "versions.md").read_text().splitlines()
        if row.startswith("| 2.")
    }
    wrong = []
    for release, files in sorted(subsets.items()):
        row = next((r for name, r in rows.items() if name.startswith(release + " ")), None)
        if row is None:
            wrong.append(f"no row for torch {release}, which .ci/run tests")
            continue
        missing = sorted(files - set(re.findall(r"`(test_\w+)`", row)))
        if missing:
            wrong.append(f"torch {release}: .ci/run runs {missing}, which the row leaves out")
    ci = (DOCS.parent / ".ci" / "run").read_text()
    main_torch = re.findall(r"pip install -q torch==(\S+)\n", ci)[-1]
    if not any(n.startswith(main_torch) and "full test suite" in r for n, r in rows.items()):
        wrong.append(f"versions.md does not say the full suite runs on torch {main_torch}")
    assert not wrong, wrong


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
