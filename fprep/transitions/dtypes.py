"""Parameter dtypes the plan must settle before FSDP2 or the optimizer sees them.

* ``fully_shard`` keeps one dtype per parameter group (a wrap unit): its trainable parameters
  must share their dtype, whatever the precision, or the first forward fails inside FSDP
  (``FSDP expects uniform original parameter dtype``).
* FSDP2's mixed precision casts floating-point parameters only: a trainable complex parameter
  would be gathered uncast beside the cast ones and its gradient reduced in the (real) reduce
  dtype, so it fails in forward (or loses its imaginary part).
* Mixed precision over parameters already in 16 bits changes nothing about the weights: the
  optimizer then keeps 16-bit master weights and state. Not an error (some want exactly that),
  but a note, since transformers builds a bf16 model from a bf16 ``config.json`` silently.
"""

from __future__ import annotations

from collections.abc import Iterable

from fprep.errors import ModelError
from fprep.snapshot import ModuleTree
from fprep.state import ShardSpec, WrapUnit

_SIXTEEN_BIT = ("float16", "bfloat16")


def is_floating(dtype: str) -> bool:
    return dtype.startswith("float") or dtype == "bfloat16"


def check_unit_dtypes(units: Iterable[WrapUnit], mixed: bool) -> None:
    """A ``ModelError`` naming the parameter FSDP2 could not handle (see the module docs)."""
    for unit in units:
        trainable = [p for p in unit.params if p.requires_grad]
        if mixed:
            for p in trainable:
                if not is_floating(p.dtype):
                    raise _not_floating(p)
        if trainable and any(p.dtype != trainable[0].dtype for p in trainable):
            numel: dict[str, int] = {}
            for p in trainable:
                numel[p.dtype] = numel.get(p.dtype, 0) + p.numel
            usual = max(numel, key=lambda d: numel[d])  # most of the unit: name the others
            first = next(p for p in trainable if p.dtype == usual)
            odd = next(p for p in trainable if p.dtype != usual)
            where = f"wrap unit {unit.fqn!r}" if unit.fqn else "the root wrap unit"
            raise ModelError(
                f"{where} holds trainable parameters of two dtypes: {first.fqn!r} is "
                f"{first.dtype}, {odd.fqn!r} is {odd.dtype}; FSDP keeps one dtype per wrap "
                "unit, so the first forward would fail.",
                subject=odd.fqn,
                hint="Cast the model to one dtype before prepare (model.to(torch.float32)), "
                f"give the module of {odd.fqn!r} a wrap unit of its own (wrap=...), or freeze "
                "the parameter (requires_grad=False).",
            )


def _not_floating(p: ShardSpec) -> ModelError:
    return ModelError(
        f"parameter {p.fqn!r} is {p.dtype}: FSDP's mixed precision casts floating-point "
        "parameters only, so this trainable one would be gathered uncast and its gradient "
        "reduced in a real dtype (the forward fails, or the imaginary part is lost).",
        subject=p.fqn,
        hint="Use precision='no' for this model, keep the parameter out of sharding "
        "(ignored_params / ignored_modules), or store it as two real parameters.",
    )


def sixteen_bit_note(tree: ModuleTree, ignored: frozenset[str], precision: str) -> str | None:
    """A note when mixed precision meets trainable parameters already 16-bit."""
    if precision == "no":
        return None
    low = [
        p
        for p in tree.params
        if p.requires_grad and p.dtype in _SIXTEEN_BIT and p.fqn not in ignored
    ]
    if not low:
        return None
    dtypes = sorted({p.dtype for p in low})
    return (
        f"{len(low)} trainable parameter(s) (first {low[0].fqn!r}) are already "
        f"{'/'.join(dtypes)}: with precision={precision!r} the master weights and the "
        "optimizer state stay 16-bit too (mixed precision keeps float32 copies only of "
        "float32 parameters). For float32 master weights build the model in float32 "
        "(transformers: from_config(config, dtype=torch.float32), torch_dtype= before "
        "transformers 4.56; or model.float()) before prepare."
    )
