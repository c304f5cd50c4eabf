"""Tiny mixture-of-experts transformers models, saved and loaded, for tests/test_weights_moe.py
(module level: the rank functions are pickled into spawned ranks)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import transformers as tf
from _weights_workers import full_state, mismatches
from torch import nn

import fprep

#: 5 experts: uneven shards at 2 ranks (3 + 2) and 4 ranks (2 + 2 + 1 + 0).
EXPERTS = 5


def config(family: str) -> Any:
    """A tiny config of ``family`` (two layers, the second of experts for DeepSeek V3)."""
    common: dict[str, Any] = dict(
        vocab_size=61, hidden_size=16, num_hidden_layers=2, num_attention_heads=2
    )
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common, intermediate_size=32, moe_intermediate_size=8, num_key_value_heads=1,
            head_dim=8, num_experts=EXPERTS, num_experts_per_tok=2, decoder_sparse_step=1,
        )  # fmt: skip
    if family == "mixtral":
        return tf.MixtralConfig(
            **common, intermediate_size=8, num_key_value_heads=1, head_dim=8,
            num_local_experts=EXPERTS, num_experts_per_tok=2,
        )  # fmt: skip
    if family == "gpt_oss":
        return tf.GptOssConfig(
            **common, intermediate_size=8, num_key_value_heads=1, head_dim=8,
            num_local_experts=EXPERTS, num_experts_per_tok=2,
        )  # fmt: skip
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **common, intermediate_size=32, moe_intermediate_size=8,
            shared_expert_intermediate_size=8, num_key_value_heads=1, num_experts=EXPERTS,
            num_experts_per_tok=2,
        )  # fmt: skip
    assert family == "deepseek_v3", family
    return tf.DeepseekV3Config(
        **common, intermediate_size=32, moe_intermediate_size=8, num_key_value_heads=2,
        n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, n_group=1, topk_group=1,
    )  # fmt: skip


FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "deepseek_v3")


def save(family: str, directory: Path, dtype: torch.dtype = torch.float32) -> Path:
    """``save_pretrained`` of a seeded model of ``family``, over several files."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config(family))
    model.to(dtype).save_pretrained(directory, max_shard_size="8KB")
    return directory


def on_meta(family: str) -> nn.Module:
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(config(family))


def reference(directory: Path) -> dict[str, torch.Tensor]:
    """What transformers loads from ``directory`` (fp32), by the model's names."""
    model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}


def loaded(family: str, directory: Path, **cfg: Any) -> dict[str, torch.Tensor]:
    """The full tensors of ``family`` prepared with ``weights=directory`` (this rank's view)."""
    _, model = fprep.prepare(on_meta(family), fprep.PrepConfig(weights=str(directory), **cfg))
    return full_state(model)


#: Every layout a spawned job runs, by world size.
LAYOUTS: dict[int, list[dict[str, Any]]] = {
    2: [dict(strategy="fsdp"), dict(strategy="ddp")],
    4: [dict(strategy="fsdp"), dict(strategy="hsdp", hsdp_shard_size=2)],
}
FUSED = "model.layers.1.mlp.experts.gate_up_proj"


def rank_load(dirs: dict[str, str]) -> dict[str, Any]:
    """Each family at each layout of this world: the names whose full tensor differs from
    what transformers loads (read on this rank, in one process); and what Qwen3-MoE's fused
    ``gate_up_proj`` of layer 1 reads under fsdp (the file's keys, bytes, and its shape)."""
    world = int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {"mismatches": {}}
    for family, directory in dirs.items():
        want = reference(Path(directory))
        for layout in LAYOUTS[world]:
            state, model = fprep.prepare(
                on_meta(family), fprep.PrepConfig(weights=directory, **layout)
            )
            out["mismatches"][f"{family} {layout}"] = mismatches(full_state(model), want)
            if family == "qwen3_moe" and layout["strategy"] == "fsdp":
                (read,) = [r for r in state.state_dict.weights.reads if r.name == FUSED]
                out["keys"] = [s.key for s in read.segments]
                out["nbytes"] = read.nbytes
                out["shape"] = tuple(want[FUSED].shape)
    return out


def rank_export(dirs: dict[str, str], out: str) -> None:
    """Each family loaded under fsdp, written with ``fprep.save_pretrained`` into
    ``out/family`` and with ``fprep.export_full`` into ``out/family.safetensors``."""
    for family, directory in dirs.items():
        state, model = fprep.prepare(
            on_meta(family), fprep.PrepConfig(strategy="fsdp", weights=directory)
        )
        fprep.save_pretrained(Path(out) / family, state, model)
        fprep.export_full(Path(out) / f"{family}.safetensors", state, model)


def rank_pipeline(directory: str) -> dict[str, Any]:
    """Qwen3-MoE at pp 2 (one layer per stage): this stage's tensors that differ from what
    transformers loads, and the names it holds."""
    want = reference(Path(directory))
    _, model = fprep.prepare(
        on_meta("qwen3_moe"), fprep.PrepConfig(weights=directory, pp=2, strategy="fsdp")
    )
    got = full_state(model)
    return {"mismatches": mismatches(got, {k: want[k] for k in got}), "names": sorted(got)}


def qwen3_vl_moe() -> Any:
    """A tiny Qwen3-VL-MoE: its mapping transposes fused experts of another shape than the
    model's (``Transpose(check_dims=True)``), and leaves them as they are otherwise."""
    text = dict(
        vocab_size=61, hidden_size=24, intermediate_size=32, moe_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=EXPERTS, num_experts_per_tok=2, decoder_sparse_step=1,
        rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]},
    )  # fmt: skip
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=24,
        patch_size=4, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0],
    )  # fmt: skip
    return tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision)
