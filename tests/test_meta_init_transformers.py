"""Models that bring their own initialisation, built on the meta device: real transformers
architectures (tiny configs) initialised by their ``_init_weights`` convention, a torchtitan-style
``init_weights()`` root, and the ``param_init_fn`` contract (called on parents too).

Checked: the plan records the convention; per-parameter statistics match an eager-constructed
model of the same config; ties stay tied; non-persistent buffers (rotary ``inv_freq``,
``position_ids``) equal the eager ones; the full parameters are bitwise the same at world sizes
1, 2 and 3 (fake process groups, real FSDP2) and across strategies, and at 2 gloo ranks (slow).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import _prepare_workers as W
import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fprep
from fprep.testing.distributed import fake_world, run_ranks

SEED = 11


def llama() -> nn.Module:
    cfg = tf.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        tie_word_embeddings=True,
    )
    return tf.LlamaForCausalLM(cfg)


def gpt2() -> nn.Module:
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=97))


def t5() -> nn.Module:
    cfg = tf.T5Config(
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        vocab_size=97,
        decoder_start_token_id=0,
    )
    return tf.T5ForConditionalGeneration(cfg)


def bert() -> nn.Module:
    cfg = tf.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=97,
        max_position_embeddings=40,
    )
    return tf.BertModel(cfg)


def mixtral() -> nn.Module:
    cfg = tf.MixtralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=97,
    )
    return tf.MixtralForCausalLM(cfg)


def vit() -> nn.Module:
    cfg = tf.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
    )
    return tf.ViTModel(cfg)


class Attention(nn.Module):
    """torchtitan style: no reset_parameters; the root's ``init_weights`` sets everything."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.wq.weight, std=0.02)  # torch 2.13's: not row-local
        nn.init.normal_(self.wo.weight, std=std)


class Titan(nn.Module):
    def __init__(self, dim: int = 16, layers: int = 3, vocab: int = 37) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Attention(dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs", torch.empty(dim // 2), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        self.freqs.copy_(
            1.0 / (10000 ** (torch.arange(0, self.freqs.numel()) / self.freqs.numel()))
        )
        nn.init.normal_(self.tok_embeddings.weight)
        for i, layer in enumerate(self.layers):
            layer.init_weights(0.02 / math.sqrt(2 * (i + 1)))
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, std=0.5, a=-1.5, b=1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # never called
        return x


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "llama": llama,
    "gpt2": gpt2,
    "t5": t5,
    "bert": bert,
    "mixtral": mixtral,
    "vit": vit,
}


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()


def eager(build: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return build()


def prepared(
    build: Callable[[], nn.Module], world: int = 1, rank: int = 0, **cfg: Any
) -> tuple[fprep.PrepState, nn.Module]:
    model = on_meta(build)
    config = fprep.PrepConfig(seed=SEED, **{"strategy": "fsdp", **cfg})
    if world == 1:
        return fprep.prepare(model, config, topology=fprep.Topology(world_size=1, rank=0))
    with fake_world(world, rank), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fprep.prepare(model, config, topology=fprep.Topology(world_size=world, rank=rank))


def full_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: W.local_shards(model)[n] for n, _ in model.named_parameters()}


def check_like_eager(model: nn.Module, reference: nn.Module) -> None:
    """Each parameter's statistics as eager construction gives them; buffers equal."""
    got = dict(model.named_parameters())
    for name, want in reference.named_parameters():
        p = got[name].detach()
        p = p.to_local() if hasattr(p, "to_local") else p
        assert p.shape == want.shape and torch.isfinite(p).all(), name
        w = want.detach()
        if w.numel() < 2 or float(w.std()) == 0.0:
            assert torch.equal(p, w), f"{name}: constant init differs"
        elif w.numel() >= 64:
            ratio = float(p.std()) / float(w.std())
            assert 0.75 < ratio < 1.33, f"{name}: std {float(p.std()):.4g} vs {float(w.std()):.4g}"
            assert abs(float(p.mean()) - float(w.mean())) < 0.25 * float(w.std()) + 1e-6, name
    buffers = dict(model.named_buffers())
    for name, want in reference.named_buffers():
        assert torch.equal(buffers[name], want), f"buffer {name} differs from eager"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_transformers_model_from_meta_is_initialised_as_transformers_does(name: str) -> None:
    build = BUILDERS[name]
    plan = fprep.plan(on_meta(build), fprep.PrepConfig()).unwrap()
    assert plan.param_handles is not None
    assert plan.param_handles.materialize.method == "hf_init_weights"
    _, model = prepared(build, strategy="none")
    reference = eager(build)
    check_like_eager(model, reference)
    ties = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {
        n for n, _ in model.named_parameters()
    }
    eager_ties = {n for n, _ in reference.named_parameters(remove_duplicate=False)} - {
        n for n, _ in reference.named_parameters()
    }
    assert ties == eager_ties


def test_tied_llama_and_its_rotary_frequencies() -> None:
    _, model = prepared(llama)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    inv = model.model.rotary_emb.inv_freq
    assert torch.equal(inv, eager(llama).model.rotary_emb.inv_freq)


def test_gpt2_scaled_residual_projections() -> None:
    """GPT2Attention / GPT2MLP (parents) redraw their child c_proj with std 0.02/sqrt(2n)."""
    _, model = prepared(gpt2, strategy="none")
    n = model.config.n_layer
    projs = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h])
    others = torch.cat([b.attn.c_attn.weight.flatten() for b in model.transformer.h])
    assert abs(float(projs.detach().std()) - 0.02 / math.sqrt(2 * n)) < 0.002
    assert abs(float(others.detach().std()) - 0.02) < 0.002


@pytest.mark.parametrize("name", ["gpt2", "t5", "mixtral", "vit"])
def test_bitwise_the_same_at_world_sizes_1_2_3_and_across_strategies(name: str) -> None:
    build = BUILDERS[name]
    _, one = prepared(build)
    full = full_of(one)
    _, plain = prepared(build, strategy="none")
    assert all(torch.equal(p.detach(), full[n]) for n, p in plain.named_parameters())
    for world in (2, 3):
        with W.every_rank_computes_everything():
            ranks = [full_of(prepared(build, world, r, wrap=nn.Linear)[1]) for r in range(world)]
        for n, want in full.items():
            got = torch.cat([r[n] for r in ranks]) if want.dim() else ranks[0][n]
            assert torch.equal(got, want), f"{n} differs at {world} ranks"


def test_t5_with_its_bound_init_weights_as_param_init_fn() -> None:
    """T5's attention (a parent) sets q/k/v/o: with the bound ``_init_weights`` as
    ``param_init_fn`` they come out ~ d_model**-0.5, not ~1.0 (a call per leaf would give)."""
    model = on_meta(t5)
    cfg = fprep.PrepConfig(seed=SEED, param_init_fn=model._init_weights)
    state, model = fprep.prepare(model, cfg)
    assert state.param_handles is not None
    assert state.param_handles.materialize.method == "hf_init_weights"
    check_like_eager(model, eager(t5))
    q = model.encoder.block[0].layer[0].SelfAttention.q.weight
    assert float(q.detach().std()) < 0.2


def test_param_init_fn_runs_on_parents_after_their_children() -> None:
    calls: list[str] = []
    names: dict[int, str] = {}

    def init(module: nn.Module) -> None:
        calls.append(names.get(id(module), "?"))
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=1.0)
        if isinstance(module, nn.RMSNorm):
            module.reset_parameters()
        if isinstance(module, Attention):
            nn.init.zeros_(module.wo.weight)  # a parent writing its child
        if isinstance(module, Titan):
            module.freqs.fill_(1.0)

    model = on_meta(Titan)
    names.update({id(m): n for n, m in model.named_modules()})
    _, model = fprep.prepare(model, fprep.PrepConfig(seed=SEED, param_init_fn=init))
    assert all(torch.all(layer.wo.weight == 0) for layer in model.layers)
    first = [c for c in dict.fromkeys(calls)]
    assert first.index("layers.0.wo") < first.index("layers.0") < first.index("layers")
    assert first[-1] == ""


def test_torchtitan_init_weights_root() -> None:
    plan = fprep.plan(on_meta(Titan), fprep.PrepConfig()).unwrap()
    assert plan.param_handles is not None
    materialize = plan.param_handles.materialize
    assert materialize.method == "init_weights" and materialize.visits == ("",)
    _, one = prepared(Titan)
    full = full_of(one)
    torch.manual_seed(0)
    reference = Titan()
    reference.init_weights()
    check_like_eager(one, reference)
    for world in (2, 3):
        with W.every_rank_computes_everything():
            ranks = [full_of(prepared(Titan, world, r)[1]) for r in range(world)]
        for n, want in full.items():
            assert torch.equal(torch.cat([r[n] for r in ranks]), want), f"{n} at {world}"


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))


def test_no_way_to_initialise_is_a_note_in_the_plan_and_refused_by_prepare() -> None:
    model = on_meta(lambda: nn.Sequential(nn.Linear(4, 4), NoInit()))
    state = fprep.plan(model, fprep.PrepConfig()).unwrap()
    assert "cannot prepare" in state.summary() and "'1'" in state.summary()
    with pytest.raises(fprep.ModelError, match="reset_parameters") as info:
        fprep.prepare(model, fprep.PrepConfig())
    assert info.value.subject == "1"
    assert all(p.is_meta for p in model.parameters())  # before any effect


class Unwritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("table", torch.ones(3), persistent=False)

    def reset_parameters(self) -> None:
        pass  # forgets its buffer


def test_a_buffer_no_init_writes_is_refused_not_left_garbage() -> None:
    with pytest.raises(fprep.PrepareError, match="table"):
        fprep.prepare(on_meta(Unwritten), fprep.PrepConfig())


@settings(max_examples=8, deadline=None)
@given(layers=st.integers(1, 3), heads=st.sampled_from([2, 4]), world=st.integers(2, 4))
def test_gpt2_drawn_configs_are_world_size_independent(layers: int, heads: int, world: int) -> None:
    def build() -> nn.Module:
        cfg = tf.GPT2Config(n_embd=8 * heads, n_layer=layers, n_head=heads, vocab_size=31)
        return tf.GPT2LMHeadModel(cfg)

    full = full_of(prepared(build)[1])
    with W.every_rank_computes_everything():
        ranks = [full_of(prepared(build, world, r)[1]) for r in range(world)]
    for n, want in full.items():
        assert torch.equal(torch.cat([r[n] for r in ranks]), want), n


def gloo_full(name: str) -> dict[str, bytes]:
    """One gloo rank: prepare under fsdp, gather the full parameters (rank 0)."""
    warnings.filterwarnings("ignore")
    model = on_meta(BUILDERS[name])
    _, model = fprep.prepare(model, fprep.PrepConfig(seed=SEED, strategy="fsdp", wrap=nn.Linear))
    return {"params": W.dump(W.full_params(model))}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5"])
def test_two_gloo_ranks_give_the_single_process_parameters(name: str) -> None:
    ranks = run_ranks(gloo_full, 2, name)
    two = W.load(ranks[0]["params"])
    one = full_of(prepared(BUILDERS[name])[1])
    for n, want in one.items():
        assert torch.equal(two[n], want), n


class Classifier(nn.Module):
    """A plain model around a Hugging Face backbone (the common research shape): the root is no
    PreTrainedModel, the head is a plain Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = llama()
        self.head = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone.model(ids).last_hidden_state)


class OddHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = gpt2()
        self.scale = nn.Parameter(torch.ones(32))  # on the plain root: nothing initializes it


def test_hf_sub_models_of_a_plain_model_follow_their_own_convention() -> None:
    plan = fprep.plan(on_meta(Classifier), fprep.PrepConfig()).unwrap()
    assert plan.param_handles is not None
    m = plan.param_handles.materialize
    assert (m.method, m.outside, m.unavailable) == ("hf_init_weights", "reset_parameters", None)
    owner_of = dict(zip(m.visits, m.owners, strict=True))
    assert owner_of["head"] is None and "" not in owner_of  # the plain root holds nothing
    assert owner_of["backbone.model.layers.0.self_attn.q_proj"] == "backbone.model"  # nearest
    assert owner_of["backbone.lm_head"] == "backbone"
    assert m.visits.index("backbone.model.norm") < m.visits.index("backbone")  # children first
    _, model = prepared(Classifier, strategy="none")
    reference = eager(Classifier)
    check_like_eager(model, reference)  # the backbone as transformers does, the head as torch
    assert model.backbone.lm_head.weight is model.backbone.model.embed_tokens.weight
    # bitwise world-size independent, as for a bare Hugging Face model
    full = full_of(prepared(Classifier)[1])
    with W.every_rank_computes_everything():
        ranks = [full_of(prepared(Classifier, 2, r, wrap=nn.Linear)[1]) for r in range(2)]
    for n, want in full.items():
        got = torch.cat([r[n] for r in ranks]) if want.dim() else ranks[0][n]
        assert torch.equal(got, want), n


def test_a_plain_parameter_beside_hf_sub_models_is_still_refused_by_name() -> None:
    model = on_meta(OddHead)
    state = fprep.plan(model, fprep.PrepConfig()).unwrap()
    assert "cannot prepare" in state.summary() and "'<root>'" in state.summary()
    with pytest.raises(fprep.ModelError, match="reset_parameters"):
        fprep.prepare(model, fprep.PrepConfig())
    assert all(p.is_meta for p in model.parameters())  # before any effect
