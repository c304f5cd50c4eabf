"""``fprep.tensor_bytes``: the one byte view that weights and checkpoints read and write through.

A wrapper subclass has no storage of its own (reading its ``data_ptr`` once crashed a save): the
view is of the inner tensor holding its values in place, or refused."""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from fprep.tensor_bytes import byte_view, values_of


def test_the_view_is_the_tensors_own_bytes_both_ways() -> None:
    t = torch.arange(6, dtype=torch.bfloat16)
    view = byte_view(t)
    assert len(view) == 12 and bytes(view) == t.view(torch.uint8).numpy().tobytes()
    seven = torch.tensor([7.0], dtype=torch.bfloat16)  # referenced: the view does not keep it
    view[:2] = byte_view(seven)  # a write lands in t
    assert t[0].item() == 7.0
    assert len(byte_view(torch.empty(0))) == 0


def test_non_contiguous_and_wrappers_with_other_inner_data_are_refused() -> None:
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        byte_view(torch.zeros(4, 4).t())
    two = TwoTensor(torch.ones(3), torch.zeros(3))  # two inner tensors: neither is "the values"
    assert values_of(two) is None
    with pytest.raises(TypeError, match="byte_view of a TwoTensor"):
        byte_view(two)


def test_torchaos_float8_all_gather_weight_is_viewed_through_its_values() -> None:
    fsdp_utils = pytest.importorskip("torchao.float8.fsdp_utils")
    from torchao.float8.float8_training_tensor import LinearMMConfig

    inner = torch.arange(8, dtype=torch.float32)
    weight = fsdp_utils.WeightWithDynamicFloat8CastTensor(
        inner, LinearMMConfig(), torch.float8_e4m3fn
    )
    assert values_of(weight) is inner
    five = torch.tensor([5.0])
    byte_view(weight)[:4] = byte_view(five)
    assert inner[0].item() == 5.0
