"""fprep.compat: version parsing, and its decisions match the torch this test runs on."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import tomllib
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fprep import compat
from fprep.compat import Version, parse_version
from fprep.errors import ConfigError
from fprep.testing.distributed import fake_world

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.11.0+cu130", Version(2, 11, 0, "", "cu130")),
        ("2.14.1", Version(2, 14, 1)),
        ("2.15.0a0+git1a2b3c4", Version(2, 15, 0, "a0", "git1a2b3c4")),
        ("2.13.0+cpu", Version(2, 13, 0, "", "cpu")),
        ("2.12.0rc3", Version(2, 12, 0, "rc3")),
        ("2.16.0.dev20261101+cu130", Version(2, 16, 0, "", "cu130")),
        ("0.18.0", Version(0, 18, 0)),
        ("2.11", Version(2, 11, 0)),
    ],
)
def test_parse_version(text: str, expected: Version) -> None:
    assert parse_version(text) == expected


@pytest.mark.parametrize("text", ["", "two.eleven", "2", "2.x.0", "v2.13.0", "2.13.0+"])
def test_parse_version_refuses_garbage(text: str) -> None:
    with pytest.raises(ConfigError, match="cannot read torch's version"):
        parse_version(text)


@given(st.integers(0, 99), st.integers(0, 99), st.integers(0, 99), st.sampled_from(["", "cu130"]))
def test_parse_version_round_trips(major: int, minor: int, patch: int, local: str) -> None:
    version = Version(major, minor, patch, "", local)
    assert parse_version(str(version)) == version


def test_at_least_counts_a_prerelease_as_its_release() -> None:
    nightly = parse_version("2.15.0a0+git1234")
    assert nightly.at_least((2, 15)) and nightly.at_least((2, 14, 1))
    assert not parse_version("2.11.0+cu130").at_least((2, 13))
    assert parse_version("2.13.0").at_least((2, 13, 0))


@pytest.mark.parametrize(
    ("text", "supported", "word"),
    [
        ("2.11.0+cu130", True, ""),
        ("2.12.1", True, ""),
        ("2.14.1", True, ""),
        ("2.15.0", True, ""),
        ("2.15.0a0+git1234", True, ""),
        ("2.10.0", False, "older"),
        ("2.16.0", False, "newer"),
        ("2.16.0a0+git1234", False, "newer"),
    ],
)
def test_support_range(text: str, supported: bool, word: str) -> None:
    features = compat.probe_torch(text)
    assert features.supported is supported
    note = features.support_note()
    assert (note == "") is supported
    assert word in note


def test_probe_matches_the_running_torch() -> None:
    features = compat.torch_features()
    assert str(features.version) == torch.__version__
    assert features.supported, features.support_note()
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    assert features.ddp_forward_sync_buffers == ("forward_sync_buffers" in params)
    # 2.13 introduced the keyword; every release before it lacks it
    assert features.ddp_forward_sync_buffers == features.version.at_least((2, 13))


def test_pyproject_range_matches_compat() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if d.startswith("torch")]
    lo = ".".join(map(str, compat.MIN_TORCH))
    hi = f"{compat.NEWEST_TESTED[0]}.{compat.NEWEST_TESTED[1] + 1}"
    assert torch_dep == f"torch>={lo},<{hi}"


def test_ddp_accepts_the_buffer_keyword_compat_chooses() -> None:
    """The keyword reaches this torch's DDP and reads back through ``ddp_syncs_buffers``."""
    with fake_world(2, 0):
        for sync in (True, False):
            ddp = DistributedDataParallel(nn.Linear(2, 2), **compat.ddp_buffer_kwargs(sync))
            assert compat.ddp_syncs_buffers(ddp) is sync
    assert not dist.is_initialized()


@pytest.mark.skipif(importlib.util.find_spec("torchao") is not None, reason="torchao installed")
def test_float8_without_torchao_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"precision='fp8' on CUDA needs torchao >= 0\.10"):
        compat.float8_api()
