"""Small, dependency-free model builders for tests, benchmarks, the CLI and the demo.

Three families:

* ``Llama``: a Llama-shaped decoder (token embedding, blocks of grouped-query attention with
  RoPE and a SwiGLU feed-forward, RMSNorm, output projection) with the module names torchtitan
  uses (``tok_embeddings``, ``layers.N.attention.wq`` ...). ``llama_405b()`` and ``llama_8b()``
  build the published shapes on the meta device (no memory); ``llama_tiny()`` builds a small one
  on the CPU that really runs.
* ``MoE``: ``Llama`` with a top-k routed mixture of experts as its feed-forward (a ``gate``
  router, ``experts`` in two fused 3-D weights as transformers 5 and torchtitan keep them, an
  optional shared expert), recording each router call's load-balancing loss and token counts.
  ``moe_tiny()`` runs on a CPU; ``moe_8x7b()`` is Mixtral 8x7B's shape on the meta device.
* ``GPT``: a tiny GPT-2-like model with tied input/output embeddings
  (``lm_head.weight is wte.weight``), deterministic for a seed and trainable on a CPU in
  milliseconds, plus ``synthetic_batches`` to feed it.

Every module that registers parameters itself (``nn.Linear``, ``nn.Embedding``, ``nn.RMSNorm``,
``nn.LayerNorm``) has ``reset_parameters()``, so a model built on the meta device can be
materialized. RoPE angles are computed in ``forward``: there are no buffers to materialize.

The builders with no required arguments (``llama_405b``, ``llama_70b``, ``llama_8b``,
``llama_tiny``, ``moe_8x7b``, ``moe_tiny``, ``tiny_gpt``) can be named as import strings, e.g.
``fprep.testing.models:llama_405b``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fprep.moe import balance_loss

__all__ = [
    "GPT",
    "MLP",
    "Attention",
    "CausalSelfAttention",
    "Experts",
    "FeedForward",
    "GPTBlock",
    "GPTConfig",
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
    "MoE",
    "MoEBlock",
    "MoEConfig",
    "MoEFeedForward",
    "MoERouter",
    "llama",
    "llama_8b",
    "llama_70b",
    "llama_405b",
    "llama_tiny",
    "lm_loss",
    "moe",
    "moe_8x7b",
    "moe_tiny",
    "synthetic_batches",
    "tiny_gpt",
]

DeviceLike = torch.device | str


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}.{name} must be a positive int; got {value!r}")


def _build(
    factory: type[nn.Module],
    config: object,
    device: DeviceLike | None,
    dtype: torch.dtype | None,
    seed: int | None,
) -> nn.Module:
    # None: the current default device, so ``with torch.device("meta"): tiny_gpt()`` is meta.
    dev = torch.device(device) if device is not None else torch.get_default_device()
    if seed is None or dev.type == "meta":
        with dev:
            model = factory(config)
    else:
        with torch.random.fork_rng(devices=[]), dev:
            torch.manual_seed(seed)
            model = factory(config)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


# -- Llama -----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a Llama-style decoder. ``ffn_dim`` is the SwiGLU hidden size."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 160
    vocab_size: int = 256
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    def __post_init__(self) -> None:
        _check_positive(
            "LlamaConfig",
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=self.ffn_dim,
            vocab_size=self.vocab_size,
        )
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        attention = 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim  # wq, wo; wk, wv
        feed_forward = 3 * self.dim * self.ffn_dim  # w1, w2, w3
        return attention + feed_forward + 2 * self.dim  # two RMSNorm weights

    @property
    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return embeddings + self.n_layers * self.params_per_layer + self.dim  # + final norm


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, seq, heads, head_dim), interleaved pairs."""
    seq, head_dim = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos = angles.cos()[None, :, None, :]
    sin = angles.sin()[None, :, None, :]
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE; projections without bias."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads, as transformers reshapes: under tensor parallelism wq / wk / wv are
        # colwise-sharded and each rank computes n_heads / tp of the heads
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = _rope(q, self.rope_theta), _rope(k, self.rope_theta)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        result: torch.Tensor = self.wo(out)
        return result


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return result


class LlamaBlock(nn.Module):
    """Pre-norm transformer block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``;
    ``feed_forward`` replaces the SwiGLU (``MoEBlock`` passes its routed experts)."""

    def __init__(self, config: LlamaConfig, feed_forward: nn.Module | None = None) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = feed_forward if feed_forward is not None else FeedForward(config)
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class Llama(nn.Module):
    """Llama-shaped decoder: tokens (batch, seq) -> logits (batch, seq, vocab).

    ``_tp_plan`` is its tensor-parallel plan (Megatron's, as torchtitan applies it), used by
    ``PrepConfig(tp=N)`` when no ``tp_plan`` is given: vocabulary-sharded embedding, column-
    then row-sharded attention and feed-forward, and a vocabulary-sharded output gathered back.
    """

    _tp_plan: ClassVar[dict[str, str]] = {
        "tok_embeddings": "embedding_rowwise",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "output": "colwise_gather_output",
    }
    #: Its pipeline plan (transformers' format): the modules ``forward`` runs in sequence, each
    #: given the previous one's output, so a stage can pass through the ones it does not hold.
    _pp_plan: ClassVar[dict[str, tuple[list[str], list[str]]]] = {
        "tok_embeddings": (["tokens"], ["h"]),
        "layers": (["h"], ["h"]),
        "norm": (["h"], ["h"]),
        "output": (["h"], ["logits"]),
    }

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits: torch.Tensor = self.output(self.norm(h))
        return logits


def llama(
    config: LlamaConfig,
    device: DeviceLike | None = "meta",
    *,
    dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> Llama:
    """Build a ``Llama`` on ``device`` (the meta device by default: no memory, no init cost).

    With ``seed`` the initial weights on a real device are deterministic; the global RNG is left
    as it was.
    """
    model = _build(Llama, config, device, dtype, seed)
    assert isinstance(model, Llama)
    return model


#: Llama 3.1 405B: 126 layers, dim 16384, 128 heads (8 kv), SwiGLU 53248, vocab 128256.
LLAMA_405B = LlamaConfig(
    dim=16384,
    n_layers=126,
    n_heads=128,
    n_kv_heads=8,
    ffn_dim=53248,
    vocab_size=128256,
)
#: Llama 3 70B.
LLAMA_70B = LlamaConfig(
    dim=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    ffn_dim=28672,
    vocab_size=128256,
)
#: Llama 3 8B.
LLAMA_8B = LlamaConfig(
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim=14336,
    vocab_size=128256,
)
#: A Llama that runs on a CPU in milliseconds (odd sizes on purpose: 160 and 256 rows shard
#: unevenly over many worlds).
LLAMA_TINY = LlamaConfig()


def llama_405b(device: DeviceLike = "meta", *, dtype: torch.dtype | None = None) -> Llama:
    """Llama 3.1 405B-shaped (about 405.8e9 parameters), on the meta device by default."""
    return llama(LLAMA_405B, device, dtype=dtype)


def llama_70b(device: DeviceLike = "meta", *, dtype: torch.dtype | None = None) -> Llama:
    """Llama 3 70B-shaped (about 70.6e9 parameters), on the meta device by default."""
    return llama(LLAMA_70B, device, dtype=dtype)


def llama_8b(device: DeviceLike = "meta", *, dtype: torch.dtype | None = None) -> Llama:
    """Llama 3 8B-shaped (about 8.03e9 parameters), on the meta device by default."""
    return llama(LLAMA_8B, device, dtype=dtype)


def llama_tiny(
    device: DeviceLike | None = None,
    *,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    tie_embeddings: bool = False,
) -> Llama:
    """A small ``Llama`` (``LLAMA_TINY``) on the default device (CPU unless a ``torch.device``
    context says otherwise), deterministic for ``seed``."""
    config = LLAMA_TINY if not tie_embeddings else LlamaConfig(tie_embeddings=True)
    return llama(config, device, dtype=dtype, seed=seed)


# -- mixture of experts ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MoEConfig(LlamaConfig):
    """Shape of ``MoE``: a ``LlamaConfig`` whose feed-forward is ``n_experts`` SwiGLU experts of
    hidden size ``expert_dim``, each token sent to ``top_k`` of them; ``shared_expert=True``
    adds a dense SwiGLU of size ``ffn_dim`` that every token goes through as well."""

    n_experts: int = 8
    top_k: int = 2
    expert_dim: int = 32
    shared_expert: bool = False
    #: renormalize the chosen experts' probabilities to sum to one (Mixtral, Qwen3-MoE)
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(
            "MoEConfig", n_experts=self.n_experts, top_k=self.top_k, expert_dim=self.expert_dim
        )
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k {self.top_k} exceeds n_experts {self.n_experts}")

    @property
    def params_per_layer(self) -> int:
        attention = 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim
        experts = self.n_experts * 3 * self.dim * self.expert_dim + self.n_experts * self.dim
        shared = 3 * self.dim * self.ffn_dim if self.shared_expert else 0
        return attention + experts + shared + 2 * self.dim


class MoERouter(nn.Module):
    """Top-k router: ``x`` (tokens, dim) -> ``(logits, weights, indices)``, as transformers 5's
    ``Qwen3MoeTopKRouter`` returns them: the logits (tokens, n_experts), the chosen experts'
    weights (tokens, top_k) and their indices (tokens, top_k, int64).

    Each call records ``aux_loss`` (``balance_loss`` of the call, with its gradient path) and
    ``tokens_per_expert`` (n_experts,) int64, read by ``MoE.aux_loss()`` and by
    ``fprep.moe.watch_routers``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts = config.n_experts
        self.top_k = config.top_k
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.n_experts, config.dim))
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.weight.shape[1] ** -0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.aux_loss = balance_loss(logits, indices, self.num_experts)
        flat = indices.detach().reshape(-1)
        self.tokens_per_expert = torch.zeros(
            self.num_experts, dtype=torch.int64, device=flat.device
        ).index_add_(0, flat, torch.ones_like(flat))
        return logits, weights.to(x.dtype), indices


class Experts(nn.Module):
    """``n_experts`` SwiGLU feed-forwards in two fused parameters, transformers 5's and
    torchtitan's layout: ``gate_up_proj`` (n_experts, 2 * expert_dim, dim), the gate's rows
    then the up projection's, and ``down_proj`` (n_experts, dim, expert_dim).

    ``forward`` is the whole expert computation, one loop over the experts that received
    tokens; a grouped GEMM or expert parallelism replaces this one method."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts = config.n_experts
        self.gate_up_proj = nn.Parameter(
            torch.empty(config.n_experts, 2 * config.expert_dim, config.dim)
        )
        self.down_proj = nn.Parameter(torch.empty(config.n_experts, config.dim, config.expert_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=self.gate_up_proj.shape[2] ** -0.5)
        nn.init.normal_(self.down_proj, std=self.down_proj.shape[2] ** -0.5)

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """``x`` (tokens, dim), each token's ``indices`` and ``weights`` (tokens, top_k) ->
        (tokens, dim): the weighted sum of its experts' outputs."""
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            token, slot = torch.where(indices == expert)
            if token.numel() == 0:
                continue  # its rows of the fused weights get a zero gradient
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out = out.index_add(0, token, y * weights[token, slot, None])
        return out


class MoEFeedForward(nn.Module):
    """Routed experts (and the optional shared expert) of one block: (batch, seq, dim) in and
    out; the router is ``gate``, as in transformers' Qwen3-MoE and Mixtral."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.gate = MoERouter(config)
        self.experts = Experts(config)
        self.shared_expert = FeedForward(config) if config.shared_expert else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        _, weights, indices = self.gate(tokens)
        out: torch.Tensor = self.experts(tokens, indices, weights).reshape(x.shape)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out


class MoEBlock(LlamaBlock):
    """A ``LlamaBlock`` whose feed-forward is ``MoEFeedForward``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config, MoEFeedForward(config))


class MoE(nn.Module):
    """Llama-shaped mixture-of-experts decoder: tokens (batch, seq) -> logits (batch, seq, vocab).

    Module names follow ``Llama`` (``layers.N.feed_forward.gate`` is a router,
    ``layers.N.feed_forward.experts`` its experts). ``aux_loss()`` is the sum over the layers of
    the last forward's load-balancing losses; ``_pp_plan`` lets pipeline parallelism split it.
    """

    _pp_plan: ClassVar[dict[str, tuple[list[str], list[str]]]] = Llama._pp_plan

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits: torch.Tensor = self.output(self.norm(h))
        return logits

    def aux_loss(self) -> torch.Tensor:
        """The sum over the layers of the last forward's ``balance_loss`` (with its gradient
        path: add ``coef * model.aux_loss()`` to the training loss)."""
        losses = [
            m.aux_loss
            for m in self.modules()
            if isinstance(m, MoERouter) and m.aux_loss is not None
        ]
        if not losses:
            raise RuntimeError("MoE.aux_loss() is known after a forward")
        return torch.stack(losses).sum()


def moe(
    config: MoEConfig,
    device: DeviceLike | None = "meta",
    *,
    dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> MoE:
    """Build a ``MoE`` on ``device`` (the meta device by default), deterministic for ``seed``
    on a real device."""
    model = _build(MoE, config, device, dtype, seed)
    assert isinstance(model, MoE)
    return model


#: Mixtral 8x7B's shape: 32 layers, dim 4096, 32 heads (8 kv), 8 experts of 14336, top 2.
MOE_8X7B = MoEConfig(
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    vocab_size=32000,
    n_experts=8,
    top_k=2,
    expert_dim=14336,
    rope_theta=1e6,
)
#: A MoE that runs on a CPU in milliseconds.
MOE_TINY = MoEConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)


def moe_8x7b(device: DeviceLike = "meta", *, dtype: torch.dtype | None = None) -> MoE:
    """Mixtral 8x7B-shaped (about 46.7e9 parameters), on the meta device by default."""
    return moe(MOE_8X7B, device, dtype=dtype)


def moe_tiny(
    device: DeviceLike | None = None,
    *,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    shared_expert: bool = False,
    **changes: Any,
) -> MoE:
    """A small ``MoE`` (``MOE_TINY`` with ``changes`` over it, e.g. ``n_layers=4``) on the
    default device, deterministic for ``seed``; ``shared_expert=True`` adds the shared expert."""
    config = dataclasses.replace(MOE_TINY, shared_expert=shared_expert, **changes)
    return moe(config, device, dtype=dtype, seed=seed)


# -- tiny GPT --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 32  # longest sequence (learned positions)
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    bias: bool = True

    def __post_init__(self) -> None:
        _check_positive(
            "GPTConfig",
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
        )
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")

    @property
    def num_params(self) -> int:
        """Parameter count (the tied embedding counted once)."""
        e, b = self.n_embd, int(self.bias)
        block = (
            2 * 2 * e  # two LayerNorms (weight, bias)
            + (e * 3 * e + b * 3 * e)  # c_attn
            + (e * e + b * e)  # attn c_proj
            + (e * 4 * e + b * 4 * e)  # c_fc
            + (4 * e * e + b * e)  # mlp c_proj
        )
        return (self.vocab_size + self.block_size) * e + self.n_layer * block + 2 * e


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, embd = x.shape
        q, k, v = self.c_attn(x).split(embd, dim=2)
        shape = (batch, seq, self.n_head, embd // self.n_head)
        out = F.scaled_dot_product_attention(
            q.view(shape).transpose(1, 2),
            k.view(shape).transpose(1, 2),
            v.view(shape).transpose(1, 2),
            is_causal=True,
        )
        result: torch.Tensor = self.c_proj(out.transpose(1, 2).reshape(batch, seq, embd))
        return result


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.c_proj(F.gelu(self.c_fc(x)))
        return result


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """GPT-2-like language model whose output projection is the token embedding (tied)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, two names

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, vocab)."""
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        pos = torch.arange(seq, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits


def tiny_gpt(
    config: GPTConfig | None = None,
    *,
    seed: int = 0,
    device: DeviceLike | None = None,
    dtype: torch.dtype | None = None,
) -> GPT:
    """A tiny ``GPT`` whose weights depend only on ``seed`` (the global RNG is left as it was),
    on the default device (CPU unless a ``torch.device`` context says otherwise)."""
    model = _build(GPT, config or GPTConfig(), device, dtype, seed)
    assert isinstance(model, GPT)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of logits (batch, seq, vocab) against targets (batch, seq)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def synthetic_batches(
    n_batches: int,
    *,
    batch_size: int = 8,
    seq_len: int = 16,
    vocab_size: int = 64,
    seed: int = 0,
    device: DeviceLike = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` of ``(inputs, targets)`` token tensors (batch_size, seq_len), int64.

    Each row is an arithmetic progression modulo ``vocab_size`` with a random start and a random
    step in [1, 4), so a model can learn it (loss falls quickly) and targets are the inputs
    shifted by one. Drawn from a ``torch.Generator`` seeded with ``seed``: the same arguments
    give the same batches, and the global RNG is not touched.
    """
    _check_positive(
        "synthetic_batches",
        batch_size=batch_size,
        seq_len=seq_len,
        vocab_size=vocab_size,
    )
    if n_batches < 0:
        raise ValueError(f"n_batches must be >= 0; got {n_batches}")
    gen = torch.Generator().manual_seed(seed)
    steps = torch.arange(seq_len + 1)
    for _ in range(n_batches):
        start = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
        stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
        tokens = (start + stride * steps) % vocab_size
        yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)
