"""Rank functions for tests/test_tp_module_styles.py, and their single-process references.

Tiny transformers models whose own tp plans name the styles beyond colwise / rowwise
(``fprep.apply.tp_module_styles``). Each plan is the model's ``tp_plan`` expanded as
transformers expands it (one rule per module or parameter); colwise / rowwise modules get
torch's styles (``fprep.apply.parallelize.torch_style``), every other module one
``ModuleStyle`` with its parameters' placements, as transformers' styles place them.
``prepared_run`` goes through ``fprep.prepare`` instead (fprep's own plan of the model).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import transformers as tf
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from fprep.apply.parallelize import torch_style
from fprep.apply.strided_dcp import copy_back, dcp_blocks
from fprep.apply.tp_module_styles import BEHAVIOURS, ModuleStyle
from fprep.layout.styles import STYLES

SEED = 3
VOCAB = 64
BATCH = 4
SEQ = 8
STEPS = 2

_COMMON: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
_MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)

#: name -> (config class, model class, config fields over _COMMON)
MODELS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=8)),
    "qwen3_moe": (
        tf.Qwen3MoeConfig,
        tf.Qwen3MoeForCausalLM,
        dict(head_dim=8, num_experts=4, decoder_sparse_step=1, **_MOE),
    ),
    "mixtral": (
        tf.MixtralConfig,
        tf.MixtralForCausalLM,
        dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2),
    ),
    "deepseek_v2": (  # layer 0 dense, layer 1 experts + a shared expert
        tf.DeepseekV2Config,
        tf.DeepseekV2ForCausalLM,
        dict(
            q_lora_rank=None,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            num_key_value_heads=4,
            **_MOE,
            **_MLA,
        ),
    ),
    "longcat_flash": (  # two attentions per layer, two identity (zero) experts
        tf.LongcatFlashConfig,
        tf.LongcatFlashForCausalLM,
        dict(
            q_lora_rank=16,
            n_routed_experts=4,
            moe_topk=2,
            zero_expert_num=2,
            expert_ffn_hidden_size=16,
            ffn_hidden_size=48,
            num_layers=1,
            head_dim=8,
            num_key_value_heads=4,
            **_MLA,
        ),
    ),
    "mimo_v2_flash": (  # layer 1: sliding-window attention with sinks, experts
        tf.MiMoV2FlashConfig,
        tf.MiMoV2FlashForCausalLM,
        dict(head_dim=8, v_head_dim=8, n_routed_experts=4, sliding_window=4, **_MOE),
    ),
    "aria": (  # packed_rowwise gate/up: the experts' weights are stored (in, out)
        tf.AriaTextConfig,
        tf.AriaTextForCausalLM,
        dict(head_dim=8, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1, pad_token_id=0),
    ),
    "phi3": (  # a fused gate_up_proj Linear: packed_colwise on a module (REPLACED)
        tf.Phi3Config,
        tf.Phi3ForCausalLM,
        dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    ),
    "inkling": (  # all_reduce shared experts
        tf.InklingTextConfig,
        tf.InklingForCausalLM,
        dict(
            head_dim=8,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=8,
            sliding_window_size=4,
            n_routed_experts=4,
            n_shared_experts=1,
            d_rel=4,
            rel_extent=8,
            **_MOE,
        ),
    ),
}


#: plan rules these tests leave out, by model class: torch's RowwiseParallel cannot shard
#: Inkling's embedding (an Embedding subclass holding a norm: a KeyError, "parameter name can't
#: contain '.'"), which has nothing to do with the styles under test
LEFT_OUT: dict[str, tuple[str, ...]] = {
    "InklingForCausalLM": ("model.embed_tokens", "model.embed_tokens.weight"),
}

#: plan rules these tests replace, by model class (FQN suffix -> style): Inkling's plan says
#: 'colwise' for the experts' gate_up_proj, which its forward halves into gate and up
#: (``chunk(2)``), so each rank needs its block of each half: 'packed_colwise'. With
#: 'colwise' one rank holds gate rows only (its loss differs from one process by 3e-6 here)
REPLACED: dict[str, dict[str, str]] = {
    "InklingForCausalLM": {"mlp.experts.gate_up_proj": "packed_colwise"},
    # Phi3's own plan gathers the fused gate_up output: here it stays this rank's halves
    "Phi3ForCausalLM": {"mlp.gate_up_proj": "packed_colwise", "mlp.down_proj": "rowwise"},
}


def build(name: str, seed: int = SEED) -> nn.Module:
    config_cls, model_cls, fields = MODELS[name]
    torch.manual_seed(seed)
    model: nn.Module = model_cls(config_cls(**{**_COMMON, **fields}))
    return model


def batch(step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=x, labels=x).loss
    return loss


def placement_of(style: str, param: str, ndim: int) -> Placement:
    """Where transformers' style ``style`` puts a parameter of ``ndim`` dims named ``param``
    (a packed gate/up is strided, so each half is sharded on its own)."""
    if style == "packed_colwise":
        return Shard(0) if ndim == 1 else _StridedShard(ndim - 2, split_factor=2)
    if style == "packed_rowwise":
        return Replicate() if ndim == 1 else _StridedShard(ndim - 1, split_factor=2)
    if style == "colwise":
        return Shard(max(ndim - 2, 0))
    if style == "rowwise":
        return Replicate() if param == "bias" or ndim == 1 else Shard(ndim - 1)
    return Replicate()  # a behaviour's own parameters are whole on every rank


#: the styles torch's own classes apply (``torch_style``)
TORCH_STYLES = frozenset(
    n
    for n, s in STYLES.items()
    if s.kind in ("colwise", "rowwise", "sequence", "gather", "scatter")
)


def tp_styles(model: nn.Module) -> dict[str, ParallelStyle]:
    """The model's own tp plan, expanded as transformers does, as one style per module."""
    expanded: dict[str, str] = model._expand_parallel_plan(model.tp_plan)  # type: ignore[operator]
    for fqn in LEFT_OUT.get(type(model).__name__, ()):
        expanded.pop(fqn)
    for suffix, style in REPLACED.get(type(model).__name__, {}).items():
        for fqn in expanded:  # the rule and those of the module's own parameters
            if fqn.endswith(suffix) or fqn.rpartition(".")[0].endswith(suffix):
                expanded[fqn] = style
    modules = dict(model.named_modules())
    torch_styled = [  # a list: every rank must apply the styles in the same order
        n for n, s in expanded.items() if n in modules and s in STYLES and s in TORCH_STYLES
    ]
    params: dict[str, dict[str, Placement]] = {}
    behaviours: dict[str, str] = {}
    for fqn, style in expanded.items():
        if fqn in modules:
            if fqn not in torch_styled:
                behaviours[fqn] = style
            continue
        owner, _, pname = fqn.rpartition(".")
        if owner in torch_styled:
            continue  # torch's colwise / rowwise place it
        ndim = modules[owner]._parameters[pname].ndim  # type: ignore[union-attr]
        params.setdefault(owner, {})[pname] = placement_of(style, pname, ndim)
    config = model.config  # type: ignore[attr-defined]
    out: dict[str, ParallelStyle] = {n: torch_style(STYLES[expanded[n]]) for n in torch_styled}
    for owner in sorted(params.keys() | behaviours.keys()):
        behaviour = behaviours.get(owner, "none")
        assert behaviour in BEHAVIOURS, f"{owner}: {behaviour}"
        rope = getattr(config, "qk_rope_head_dim", None) if behaviour == "mla_kv_a_proj" else None
        out[owner] = ModuleStyle(behaviour, params.get(owner, {}), rope_dim=rope)  # type: ignore[arg-type]
    return out


def reference(name: str) -> dict[str, Any]:
    """One process: the loss and every parameter's gradient of one forward / backward."""
    model = build(name)
    loss = loss_of(model, batch())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads}


def _full(t: torch.Tensor) -> Any:
    """The whole tensor as a numpy array (tensors would travel between processes as shared
    memory, which a finished rank takes with it)."""
    whole = t.full_tensor() if isinstance(t, DTensor) else t
    return whole.detach().numpy().copy()


def _tp_mesh(tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))


#: suffix of a tp_run name whose decoder layers run under activation checkpointing
RECOMPUTE = "+recompute"


def _recompute_layers(model: nn.Module) -> None:
    """Each decoder layer recomputed in backward (torch's non-reentrant checkpoint): the
    styles' hooks run again there, on the same DTensor parameters."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.model.layers  # type: ignore[union-attr]
    for i, layer in enumerate(layers):  # type: ignore[arg-type]
        layers[i] = checkpoint_wrapper(layer)  # type: ignore[index]


def tp_run(names: tuple[str, ...], tp: int = 2) -> dict[str, Any]:
    """Each model under its own plan at tp ``tp`` (a name ending in ``RECOMPUTE``: with its
    layers checkpointed): loss, gradients (whole), and each planned module style's
    parameters' (placements, local shapes) as this rank sees them."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mesh = _tp_mesh(tp)
    out: dict[str, Any] = {}
    for name in names:
        model = build(name.removesuffix(RECOMPUTE))
        styles = tp_styles(model)
        parallelize_module(model, mesh, styles)  # type: ignore[arg-type]
        if name.endswith(RECOMPUTE):
            _recompute_layers(model)
        loss = loss_of(model, batch())
        loss.backward()
        grads = {  # by the names of the model without checkpoint wrappers
            n.replace("._checkpoint_wrapped_module", ""): _full(p.grad)
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        layout = {
            f"{owner}.{pname}": (
                repr(tuple(p.placements)) if isinstance(p, DTensor) else "plain",
                tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape),
            )
            for owner, style in styles.items()
            if isinstance(style, ModuleStyle)
            for pname, p in model.get_submodule(owner).named_parameters(recurse=False)
        }
        planned = {  # the placement, and the dim it splits (None: whole on every rank)
            f"{owner}.{pname}": (repr((pl,)), getattr(pl, "dim", None))
            for owner, style in styles.items()
            if isinstance(style, ModuleStyle)
            for pname, pl in style.params.items()
        }
        out[name] = {"loss": loss.item(), "grads": grads, "layout": layout, "planned": planned}
    return out


def trained_reference(name: str, steps: int = STEPS) -> dict[str, Any]:
    """One process, AdamW: per-step losses and gradients, the parameters after ``steps``
    steps."""
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        loss = loss_of(model, batch(step))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def dp_tp_run(name: str, steps: int = STEPS, ckpt_dir: str | None = None) -> dict[str, Any]:
    """dp 2 x tp 2: the module styles on the tp dim, ``fully_shard`` over dp on top, each dp
    rank given half of every batch; per-step losses (the dp mean), the parameters after
    ``steps`` AdamW steps (whole), then a DCP save / load round trip into a fresh model."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")

    def prepared(seed: int) -> nn.Module:
        model = build(name, seed)
        parallelize_module(model, mesh["tp"], tp_styles(model))  # type: ignore[arg-type]
        for layer in model.model.layers:  # type: ignore[union-attr]
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model

    model = prepared(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    half = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
    losses, grads = [], []
    for step in range(steps):
        loss = loss_of(model, batch(step)[half])
        loss.backward()  # FSDP2 averages the gradients over dp
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        losses.append(mean.item() / 2)
    params = {n: _full(p) for n, p in model.named_parameters()}
    placements = {
        n: repr(tuple(p.placements)) for n, p in model.named_parameters() if "experts" in n
    }
    # DCP round trip: save the sharded state dict, load it into a fresh (other seed) model;
    # the packed (strided) parameters go through strided_dcp's plain-Shard blocks
    path = os.path.join(ckpt_dir or tempfile.mkdtemp(), "ckpt")
    dcp.save(dcp_blocks(get_model_state_dict(model)), checkpoint_id=path)
    fresh = prepared(SEED + 1)
    state = get_model_state_dict(fresh)
    blocks = dcp_blocks(state)
    dcp.load(blocks, checkpoint_id=path)
    copy_back(blocks, state)
    set_model_state_dict(fresh, state)
    loaded = {n: _full(p) for n, p in fresh.named_parameters()}
    return {
        "losses": losses,
        "grads": grads,
        "params": params,
        "placements": placements,
        "loaded": loaded,
    }


def prepared_run(name: str, fields: dict[str, Any], steps: int = STEPS) -> dict[str, Any]:
    """``fprep.prepare`` with ``PrepConfig(**fields)`` (the model's own tp plan), ``steps``
    AdamW steps, each dp rank given its share of every batch: this rank's dp rank and
    losses, the gradients (whole) of every step and the parameters after the last one."""
    import fprep

    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state, model, opt = fprep.prepare(model, fprep.PrepConfig(**fields), opt)
    pg = state.process_group
    assert pg is not None and state.core is not None
    dp = pg.replicate_size * pg.shard_size if state.core.is_distributed else 1
    dp_rank = 0
    if state.core.is_distributed:
        for coord, size in zip(pg.coordinate, pg.mesh_shape, strict=True):
            dp_rank = dp_rank * size + coord
    per = BATCH // dp
    mine = slice(dp_rank * per, (dp_rank + 1) * per)
    losses, grads = [], []
    for step in range(steps):
        loss = loss_of(model, batch(step)[mine])
        fprep.backward(state, model, loss)  # FSDP2 averages the gradients over dp
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        fprep.optimizer_step(state, opt)
        opt.zero_grad()
        losses.append(loss.item())
    tps = state.tensor_parallel
    return {
        "dp_rank": dp_rank,
        "losses": losses,
        "grads": grads,
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "placements": {
            n: repr(tuple(p.placements)) for n, p in model.named_parameters() if "experts" in n
        },
        "notes": list(tps.notes) if tps is not None else [],
    }
