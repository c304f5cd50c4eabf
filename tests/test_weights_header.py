"""Reading safetensors headers and save_pretrained directories: every lie is a CheckpointError.

The parser is fuzzed (random bytes, and valid headers with one field changed): it returns
checked records or raises a PrepError, never anything else.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from _weights_files import write_raw, write_safetensors
from hypothesis import given
from hypothesis import strategies as st

from fprep.errors import CheckpointError, ConfigError, PrepError
from fprep.weights.header import header_length, parse, read_header
from fprep.weights.source import snapshot


def test_a_valid_file_reads_back_its_tensors(tmp_path: Path) -> None:
    a = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    b = torch.ones(5, dtype=torch.int64)
    path = write_safetensors(tmp_path / "w.safetensors", {"a": a, "b": b, "e": torch.ones(0, 3)})
    tensors, file = read_header(str(path))
    assert file.size == path.stat().st_size
    by_key = {t.key: t for t in tensors}
    assert (by_key["a"].dtype, by_key["a"].shape, by_key["a"].nbytes) == ("bfloat16", (3, 4), 24)
    raw = path.read_bytes()
    t = by_key["b"]
    assert raw[t.offset : t.offset + t.nbytes] == b.numpy().tobytes()


def _valid(tmp_path: Path) -> tuple[dict[str, object], bytes]:
    body: dict[str, object] = {
        "__metadata__": {"format": "pt"},
        "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "F16", "shape": [2], "data_offsets": [16, 20]},
    }
    return body, bytes(20)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda b: b["w"].update(dtype="F4"), "dtype 'F4'"),
        (lambda b: b["w"].update(shape=[2, -2]), "shape"),
        (lambda b: b["w"].update(shape=[2, 2.0]), "shape"),
        (lambda b: b["w"].update(data_offsets=[0, 12]), "needs 16"),
        (lambda b: b["w"].update(data_offsets=[16, 0]), "begin <= end"),
        (lambda b: b["b"].update(data_offsets=[12, 16], shape=[2]), "overlap"),
        (lambda b: b["b"].update(data_offsets=[20, 24]), "past the data section"),
        (lambda b: b["w"].pop("dtype"), "dtype, shape and data_offsets"),
        (lambda b: b.update(__metadata__=[1]), "__metadata__"),
    ],
)
def test_a_lying_header_is_refused_naming_the_key_and_file(
    tmp_path: Path, change: object, words: str
) -> None:
    body, data = _valid(tmp_path)
    change(body)  # type: ignore[operator]
    path = write_raw(tmp_path / "w.safetensors", body, data)
    with pytest.raises(CheckpointError, match=words) as info:
        read_header(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"\x01\x02", "shorter than the 8-byte"),
        ((10**12).to_bytes(8, "little") + b"{}", "header of 1000000000000 bytes"),
        ((50).to_bytes(8, "little") + b"{}", "header of 50 bytes"),
        ((4).to_bytes(8, "little") + b"[1] ", "not an object"),
        ((4).to_bytes(8, "little") + b"\xff\xfe{}", "not a safetensors file"),
        ((13).to_bytes(8, "little") + b'{"a":1,"a":1}', "duplicate key"),
    ],
)
def test_what_is_not_safetensors_is_refused(tmp_path: Path, content: bytes, words: str) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=words):
        read_header(str(path))


@given(st.binary(max_size=200), st.integers(0, 400))
def test_fuzz_random_bytes_give_a_prep_error_or_records(data: bytes, size: int) -> None:
    try:
        header_length(data[:8], size, "f")
        parse(data[8:], size, "f")
    except PrepError:
        pass


_FIELDS = st.sampled_from(["dtype", "shape", "data_offsets", "extra"])
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


@given(st.sampled_from(["w", "b", "__metadata__"]), _FIELDS, _VALUES, st.integers(0, 64))
def test_fuzz_mutated_headers_give_a_prep_error_or_consistent_records(
    key: str, field: str, value: object, size: int
) -> None:
    body: dict[str, object] = {
        "__metadata__": {"format": "pt"},
        "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "F16", "shape": [2], "data_offsets": [16, 20]},
    }
    entry = body[key]
    assert isinstance(entry, dict)
    entry[field] = value
    text = json.dumps(body).encode()
    try:
        tensors = parse(text, 8 + len(text) + size, "f")
    except PrepError:
        return
    spans = sorted((t.offset, t.offset + t.nbytes) for t in tensors if t.nbytes)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert all(end <= 8 + len(text) + size for _, end in spans)


# -- directories and indexes ------------------------------------------------------------------
def _index(directory: Path, weight_map: dict[str, object]) -> Path:
    path = directory / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def test_an_index_over_several_files(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", {"x": torch.ones(2)})
    write_safetensors(tmp_path / "b.safetensors", {"y": torch.ones(3)})
    _index(tmp_path, {"x": "a.safetensors", "y": "b.safetensors"})
    snap = snapshot(str(tmp_path))
    assert {(t.key, Path(t.file).name) for t in snap.tensors} == {
        ("x", "a.safetensors"),
        ("y", "b.safetensors"),
    }
    assert len(snap.files) == 2


@pytest.mark.parametrize("name", ["../a.safetensors", "/etc/passwd", "sub/../../a", "", 3])
def test_an_index_naming_a_file_outside_its_directory_is_refused(
    tmp_path: Path, name: object
) -> None:
    inner = tmp_path / "ckpt"
    inner.mkdir()
    write_safetensors(tmp_path / "a.safetensors", {"x": torch.ones(2)})
    _index(inner, {"x": name})
    with pytest.raises(CheckpointError, match="not a file name inside its directory") as info:
        snapshot(str(inner))
    assert info.value.subject == "x"


def test_an_index_naming_a_missing_file_or_tensor_is_refused(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", {"x": torch.ones(2)})
    _index(tmp_path, {"x": "a.safetensors", "y": "gone.safetensors"})
    with pytest.raises(CheckpointError, match=r"gone\.safetensors.*does not exist"):
        snapshot(str(tmp_path))
    _index(tmp_path, {"x": "a.safetensors", "y": "a.safetensors"})
    with pytest.raises(CheckpointError, match="holds no such tensor") as info:
        snapshot(str(tmp_path))
    assert info.value.subject == "y"
    (tmp_path / "model.safetensors.index.json").write_text('{"weights": {}}')
    with pytest.raises(CheckpointError, match="weight_map"):
        snapshot(str(tmp_path))


def test_paths_that_are_not_weights_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        snapshot(str(tmp_path / "nope"))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ConfigError, match="never unpickles") as info:
        snapshot(str(tmp_path))
    assert info.value.subject == "weights"
    with pytest.raises(ConfigError, match="never unpickles"):
        snapshot(str(tmp_path / "pytorch_model.bin"))
    (tmp_path / "pytorch_model.bin").unlink()
    write_safetensors(tmp_path / "adapter.safetensors", {"x": torch.ones(1)})
    with pytest.raises(ConfigError, match=r"adapter\.safetensors"):
        snapshot(str(tmp_path))
