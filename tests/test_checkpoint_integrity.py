"""Every byte of a checkpoint's JSON layer is protected: ``manifest.json``, ``metadata.json`` and
the ``latest`` pointer.

The manifest records the digest of every other file, and is itself sealed (it carries the
digest of its own contents); ``latest`` names a step directory and carries the digest of that
directory's ``manifest.json``. So every single-bit flip of any of them is refused with a
``CheckpointError`` (or loads exactly what was saved). The exhaustive tests flip every bit in
memory through the same functions ``load`` uses; the sampled ones load flipped files for real.
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _checkpoint_workers as W
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fprep
from fprep.checkpoint import reading
from fprep.checkpoint.format import manifest
from fprep.checkpoint.format import metadata as md_json
from fprep.checkpoint.format.files import check_bytes, digest_of, dump_json, parse_json
from fprep.checkpoint.stores import layout
from fprep.checkpoint.stores.backend import LocalStep
from fprep.errors import CheckpointError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small checkpoint of everything (optimizer, scheduler, loader, RNG, extras), saved twice
    (so that a flipped pointer can name another complete checkpoint)."""
    state, model, opt, sched, loader = W.prepared("none")
    W.Trainer(state, model, opt, sched, loader).run(2)
    root = tmp_path_factory.mktemp("integrity") / "ckpt"
    for step in (2, 3):
        kw = {"optimizers": (opt,), "scheduler": sched, "loader": loader}
        fprep.save(root, state, model, step=step, extras={"lr": 0.5, "tag": "x"}, **kw)
    step_dir = root / "step-00000003"
    return Quiet(
        root=root,
        dir=step_dir,
        manifest=(step_dir / "manifest.json").read_bytes(),
        metadata=(step_dir / "metadata.json").read_bytes(),
        latest=(root / "latest").read_bytes(),
    )


class Quiet(dict[str, Any]):
    """A dict that hypothesis does not print in full."""

    def __repr__(self) -> str:
        return f"<checkpoint at {self['root']}>"


def flipped(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def outcome(read: Callable[[], bytes], want: bytes) -> str:
    """'refused', 'identical' (the parsed result re-serializes to the same bytes) or
    'different' (a silent change: the defect)."""
    try:
        got = read()
    except CheckpointError:
        return "refused"
    return "identical" if got == want else "different"


def manifest_outcome(data: bytes, want: bytes, pinned: str | None) -> str:
    """``want``: the original manifest's bytes (``parse`` then ``to_json_bytes`` gives them
    back exactly when the parsed manifest is the same)."""
    return outcome(lambda: manifest.parse(data, pinned=pinned).to_json_bytes(), want)


# -- manifest.json -------------------------------------------------------------------------------
@given(bit=st.data())
@settings(max_examples=300)
def test_sampled_manifest_flips_are_refused(ckpt: dict[str, Any], bit: st.DataObject) -> None:
    original = ckpt["manifest"]
    assert manifest.parse(original).to_json_bytes() == original
    i = bit.draw(st.integers(0, 8 * len(original) - 1))
    data = flipped(original, i)
    for pinned in (None, digest_of(original)):  # the step directory itself; through `latest`
        assert manifest_outcome(data, original, pinned) in ("refused", "identical"), i


@pytest.mark.slow
def test_every_manifest_bit_flip_is_refused(ckpt: dict[str, Any]) -> None:
    original = ckpt["manifest"]
    counts: Counter[str] = Counter()
    for i in range(8 * len(original)):
        counts[manifest_outcome(flipped(original, i), original, None)] += 1
    assert counts["different"] == 0, counts
    assert sum(counts.values()) == 8 * len(original)
    print(f"manifest.json: {len(original)} bytes, {sum(counts.values())} flips: {dict(counts)}")


# -- metadata.json -------------------------------------------------------------------------------
def metadata_canonical(data: bytes, record: Any, sizes: dict[str, int]) -> bytes:
    """What ``load`` makes of ``metadata.json``'s bytes (checked against the manifest's
    record first), as canonical JSON."""
    check_bytes(data, record, md_json.METADATA_FILE)
    parsed = md_json.from_json(parse_json(data, md_json.METADATA_FILE), sizes)
    return dump_json(md_json.to_json(parsed))


@pytest.mark.slow
def test_every_metadata_bit_flip_is_refused(ckpt: dict[str, Any]) -> None:
    original = ckpt["metadata"]
    files = manifest.parse(ckpt["manifest"]).files
    record, sizes = files[md_json.METADATA_FILE], {n: r.size for n, r in files.items()}
    want = metadata_canonical(original, record, sizes)
    counts: Counter[str] = Counter()
    for i in range(8 * len(original)):
        data = flipped(original, i)
        counts[outcome(lambda data=data: metadata_canonical(data, record, sizes), want)] += 1
    assert counts["different"] == 0, counts
    print(f"metadata.json: {len(original)} bytes, {sum(counts.values())} flips: {dict(counts)}")


# -- latest --------------------------------------------------------------------------------------
def json_layer(root: Path) -> bytes:
    """Everything ``load`` reads before the tensor files: the manifest and metadata ``latest``
    leads to, as canonical bytes."""
    target = layout.resolve(root)
    found, meta = reading._read(LocalStep(target.step_dir), target.pinned)
    return found.to_json_bytes() + dump_json(md_json.to_json(meta))


def test_every_pointer_bit_flip_is_refused(ckpt: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt["root"], root)
    original = ckpt["latest"]
    assert layout.parse_latest(original) == ("step-00000003", digest_of(ckpt["manifest"]))
    want = json_layer(root)
    counts: Counter[str] = Counter()
    for i in range(8 * len(original)):
        (root / "latest").write_bytes(flipped(original, i))
        counts[outcome(lambda: json_layer(root), want)] += 1
    assert counts["different"] == 0, counts
    # a pointer naming the other (complete) checkpoint with the digest of this one's manifest
    (root / "latest").write_bytes(original.replace(b"00000003", b"00000002"))
    with pytest.raises(CheckpointError, match=r"does not match the blake3 digest .*latest records"):
        json_layer(root)
    print(f"latest: {len(original)} bytes, {sum(counts.values())} flips: {dict(counts)}")


# -- real loads of flipped files -----------------------------------------------------------------
@given(data=st.data())
@settings(max_examples=25)
def test_a_flipped_bit_anywhere_is_refused_by_load(
    ckpt: dict[str, Any], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    root = tmp_path_factory.mktemp("flip") / "ckpt"
    shutil.copytree(ckpt["root"], root)
    name = data.draw(st.sampled_from(["latest", "manifest.json", "metadata.json", "__0_0.distcp"]))
    path = root / name if name == "latest" else root / "step-00000003" / name
    original = path.read_bytes()
    path.write_bytes(flipped(original, data.draw(st.integers(0, 8 * len(original) - 1))))
    state, model, opt, sched, loader = W.prepared("none", seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError):
        fprep.load(root, state, model, optimizers=(opt,), scheduler=sched, loader=loader)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert len(opt.state) == 0


# -- older versions --------------------------------------------------------------------------------
def test_unsealed_version_2_manifests_and_name_only_pointers_still_load(
    ckpt: dict[str, Any], tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt["root"], root)
    step_dir = root / "step-00000003"
    body, sealed = manifest.unseal(ckpt["manifest"])
    assert sealed
    (step_dir / "manifest.json").write_bytes(body.replace(b'"version":3', b'"version":2'))
    (root / "latest").write_bytes(b"step-00000003\n")  # what fprep wrote before
    state, model, opt, sched, loader = W.prepared("none", seed=1)
    info = fprep.load(root, state, model, optimizers=(opt,), scheduler=sched, loader=loader)
    assert info.step == 3 and info.extras == {"lr": 0.5, "tag": "x"}
    # a version 3 manifest without its seal is not taken for an old one
    (step_dir / "manifest.json").write_bytes(body)
    with pytest.raises(CheckpointError, match="a version 3 manifest must be sealed"):
        fprep.load(root, state, model)
