"""fp8 planning: which Linear layers run in float8, which stay in high precision, and why.

Decided from the snapshot alone (class names and weight shapes), so ``fprep plan`` shows it
without a GPU or torchao. A Linear runs in float8 unless

* it lies in an ignored module, or matches one of ``Fp8Options.skip`` (itself or an ancestor);
* it is the output projection (``skip_output``): its ``out_features`` is the vocabulary (the
  largest ``nn.Embedding``'s ``num_embeddings``), or, in a model without embeddings, it is the
  last Linear. Its float8 matmul is slower than bf16 at these shapes and costs accuracy in the
  logits; torchtitan and Accelerate keep it in bf16 too;
* a dimension is not a multiple of 16 (float8 matmuls need both; torchao's own filters and
  torchtitan's refuse the same layers);
* on CUDA, it is too small for float8 to pay (``skip_small``): the casts and scales cost more
  than the faster matmul saves below the thresholds torchao measured on an H100 for the recipe
  (its ``_auto_filter_for_recipe``; the rowwise ones for both rowwise recipes). fprep's own
  H100 run agrees: a 0.25B Llama (width 1024) with every Linear in float8 stepped 1.44x slower
  than bf16, a 0.9B one (width 2048) 0.97x (``benchmarks/gpu_check.py``). On Gaudi no such
  measurements exist: the switch does nothing there;
* its weight is tied to another module's (converting would change what the other computes);
* it is a subclass of ``nn.Linear`` (its own forward would be replaced by torchao's), e.g. the
  output projection ``nn.MultiheadAttention`` reads directly.
"""

from __future__ import annotations

import fnmatch

from fprep.config import Fp8Options
from fprep.snapshot import ModuleInfo, ModuleTree, is_within
from fprep.state import Fp8Plan

LINEAR = "torch.nn.modules.linear.Linear"
EMBEDDING = "torch.nn.modules.sparse.Embedding"
#: float8 matmuls (cuBLAS / CUTLASS) need both dimensions to be multiples of this
FP8_DIM_MULTIPLE = 16


def _weight_shape(tree: ModuleTree, fqn: str) -> tuple[int, ...] | None:
    param = tree.param(f"{fqn}.weight" if fqn else "weight")
    return None if param is None else param.shape


def _ancestors(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _output_projections(tree: ModuleTree, linears: list[ModuleInfo]) -> dict[str, str]:
    """The output projections, each with the reason it counts as one. The vocabulary is the
    largest ``nn.Embedding`` (position embeddings are smaller, and a hidden size may equal
    their row count)."""
    rows = [
        shape[0]
        for m in tree.modules
        if m.is_a(EMBEDDING) and (shape := _weight_shape(tree, m.fqn))
    ]
    if not rows:
        return {linears[-1].fqn: "output projection (the model's last Linear)"} if linears else {}
    vocab = max(rows)
    return {
        m.fqn: f"output projection (out_features {vocab} is the vocabulary)"
        for m in linears
        if (shape := _weight_shape(tree, m.fqn)) and shape[0] == vocab
    }


def plan_fp8(
    tree: ModuleTree,
    options: Fp8Options,
    *,
    ignored_modules: tuple[str, ...],
    sharded: bool,
    device_type: str,
) -> Fp8Plan:
    """The float8 plan for ``tree`` (pure: reads the snapshot only)."""
    linears = [m for m in tree.modules if m.is_a(LINEAR)]
    outputs = _output_projections(tree, linears) if options.skip_output else {}
    modules: list[str] = []
    kept: list[tuple[str, str]] = []
    for m in dict((m.fqn, m) for m in linears).values():  # a shared module once
        reason = _kept_because(tree, m, options, ignored_modules, outputs, device_type)
        if reason:
            kept.append((m.fqn, reason))
        else:
            modules.append(m.fqn)
    gather = options.fsdp_float8_all_gather
    if gather is None:
        gather = options.recipe == "tensorwise"
    return Fp8Plan(
        recipe=options.recipe,
        modules=tuple(modules),
        kept=tuple(kept),
        fsdp_float8_all_gather=gather and sharded and device_type == "cuda" and bool(modules),
    )


def _kept_because(
    tree: ModuleTree,
    m: ModuleInfo,
    options: Fp8Options,
    ignored_modules: tuple[str, ...],
    outputs: dict[str, str],
    device_type: str,
) -> str:
    """Why ``m`` stays in high precision; empty when it runs in float8."""
    if any(is_within(m.fqn, ig) for ig in ignored_modules):
        return "ignored module"
    for pattern in options.skip:
        if any(fnmatch.fnmatchcase(a, pattern) for a in _ancestors(m.fqn)):
            return f"fp8.skip pattern {pattern!r}"
    if m.fqn in outputs:
        return outputs[m.fqn]
    if m.cls != LINEAR:
        return f"a subclass of nn.Linear ({m.cls}): torchao would replace its forward"
    weight = tree.param(f"{m.fqn}.weight" if m.fqn else "weight")
    if weight is None or len(weight.shape) != 2:
        return "no 2-D weight of its own"
    if weight.is_tied:
        others = ", ".join(n for n in weight.names if n != f"{m.fqn}.weight")
        return f"weight tied to {others}"
    out_f, in_f = weight.shape
    if out_f % FP8_DIM_MULTIPLE or in_f % FP8_DIM_MULTIPLE:
        return f"dimensions {out_f} x {in_f} are not multiples of {FP8_DIM_MULTIPLE}"
    if options.skip_small and device_type == "cuda":
        return too_small_for_float8(options.recipe, out_f, in_f)
    return ""


def too_small_for_float8(recipe: str, out_f: int, in_f: int) -> str:
    """Why float8 does not pay for an ``out_f`` x ``in_f`` weight under ``recipe`` (torchao's
    H100 thresholds); empty when it does."""
    if recipe == "tensorwise":
        small = in_f <= 4096 and out_f <= 1024
        rule = "in_features <= 4096 and out_features <= 1024"
    else:
        small = out_f <= 2048 or in_f <= 1024 or (out_f <= 4096 and in_f <= 2048)
        rule = "out_features <= 2048, in_features <= 1024, or both <= 4096 x 2048"
    if not small:
        return ""
    return (
        f"too small for float8 to pay ({recipe}: {rule}; dimensions {out_f} x {in_f}); "
        "fp8.skip_small=False converts it"
    )
