"""ModuleTree.of: one walk, metadata only, tied parameters recognised as one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fprep import ModelError, ModuleTree
from fprep.snapshot import PREPARED_ATTR, clean_fqn, is_within


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scratch", torch.zeros(3, dtype=torch.bfloat16), persistent=False)
        self.register_parameter("unused", None)


def test_walk_records_modules_in_pre_order() -> None:
    tree = ModuleTree.of(Tied())
    assert [m.fqn for m in tree.modules] == ["", "emb", "body", "body.0", "body.1", "head"]
    assert tree.root.class_name == "Tied"
    assert tree.module("body") is not None
    assert tree.module("body").children == ("body.0", "body.1")  # type: ignore[union-attr]
    assert tree.module("body.0").is_a("Linear")  # type: ignore[union-attr]
    assert tree.module("body.0").is_a("torch.nn.modules.module.Module")  # type: ignore[union-attr]
    assert not tree.module("body.0").is_a("Embedding")  # type: ignore[union-attr]


def test_tied_parameters_are_one_with_all_names() -> None:
    tree = ModuleTree.of(Tied())
    tied = tree.param("head.weight")
    assert tied is not None and tied is tree.param("emb.weight")
    assert tied.names == ("emb.weight", "head.weight")
    assert tied.fqn == "emb.weight" and tied.is_tied
    assert tied.owners == ("emb", "head")
    assert len(tree.params) == len(list(Tied().parameters()))  # deduplicated like torch
    assert tree.param("unused") is None


def test_param_and_buffer_metadata() -> None:
    model = Tied()
    model.body[0].weight.requires_grad_(False)
    tree = ModuleTree.of(model)
    w = tree.param("body.0.weight")
    assert w is not None
    assert (w.shape, w.dtype, w.device, w.requires_grad) == ((4, 4), "float32", "cpu", False)
    buffers = {b.fqn: b for b in tree.buffers}
    assert buffers["scratch"].dtype == "bfloat16" and not buffers["scratch"].persistent
    assert buffers["body.1.num_batches_tracked"].dtype == "int64"
    assert buffers["body.1.running_mean"].persistent
    assert set(buffers) == {n for n, _ in model.named_buffers()}


def test_meta_models_are_read_without_data() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)])
    tree = ModuleTree.of(model)
    assert tree.is_meta and all(p.is_meta for p in tree.params)
    assert tree.numel == 4 * (4096 * 4096 + 4096)


def test_snapshot_does_not_change_the_model() -> None:
    model = Tied()
    before = copy.deepcopy(model.state_dict())
    ModuleTree.of(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_equal_models_give_equal_trees() -> None:
    torch.manual_seed(0)
    a = ModuleTree.of(Tied())
    b = ModuleTree.of(Tied())
    assert a == b and hash(a) == hash(b)


def test_shared_module_under_two_paths() -> None:
    shared = nn.Linear(2, 2)
    model = nn.ModuleDict({"a": shared, "b": shared})
    tree = ModuleTree.of(model)
    assert [m.fqn for m in tree.modules] == ["", "a", "b"]
    assert len(tree.params) == 2
    assert tree.param("b.weight") is tree.param("a.weight")


def test_hugging_face_loading_facts() -> None:
    model = Tied()
    model.hf_device_map = {"emb": 0, "body": "cpu"}  # type: ignore[assignment]
    model.is_loaded_in_8bit = True  # type: ignore[assignment]
    tree = ModuleTree.of(model)
    assert tree.hf_device_map == (("emb", "0"), ("body", "cpu"))
    assert tree.quantization == "8bit"
    setattr(model, PREPARED_ATTR, True)
    assert ModuleTree.of(model).prepared


def test_not_a_module() -> None:
    with pytest.raises(ModelError) as info:
        ModuleTree.of("model")  # type: ignore[arg-type]
    assert info.value.subject == "model"


def test_root_must_come_first() -> None:
    from fprep.snapshot import ModuleInfo

    with pytest.raises(ModelError):
        ModuleTree(modules=(ModuleInfo(fqn="a", cls="x.A"),))


def test_clean_fqn_and_is_within() -> None:
    assert clean_fqn("_orig_mod.layers.0._checkpoint_wrapped_module.w") == "layers.0.w"
    assert clean_fqn("layers.0.w") == "layers.0.w"
    assert clean_fqn("_orig_mod") == ""
    assert is_within("a.b", "a") and is_within("a", "a") and is_within("a", "")
    assert not is_within("ab", "a")
