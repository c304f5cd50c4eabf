"""peft adapter models (LoRA) seen in a ``ModuleTree``: which parameters are adapters, which
modules peft initializes, and the name each base weight has in the base model's own checkpoint.

``get_peft_model(base, LoraConfig(...))`` puts the base model under ``base_model.model`` and
wraps each targeted layer: its original weight moves to ``<layer>.base_layer.weight`` beside the
adapters ``<layer>.lora_A.<adapter>`` and ``<layer>.lora_B.<adapter>``; a module listed in
``modules_to_save`` becomes ``<module>.original_module`` plus a trainable copy
``<module>.modules_to_save.<adapter>``. The base model's checkpoint (``save_pretrained`` of the
model before wrapping) knows none of these names: ``checkpoint_key`` undoes them, so that
``PrepConfig(weights=...)`` reads the base weights into a peft model built on the meta device.

Pure: classes are recognized by their qualified names (fprep never imports peft to plan).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fprep.errors import ConfigError
from fprep.snapshot import ModuleTree, parent_fqn

PEFT_MODEL = "peft.peft_model.PeftModel"
TUNER = "peft.tuners.tuners_utils.BaseTuner"
TUNER_LAYER = "peft.tuners.tuners_utils.BaseTunerLayer"
LORA_LAYER = "peft.tuners.lora.layer.LoraLayer"
AUXILIARY = "peft.utils.other.AuxiliaryTrainingWrapper"

#: The ``ModuleDict`` attributes of a ``LoraLayer`` holding the ``nn.Linear`` adapters peft
#: initializes with ``reset_lora_parameters``: A like ``nn.Linear`` (or Gaussian), B zeros.
LORA_FACTORS = ("lora_A", "lora_B")


@dataclass(frozen=True)
class AdapterLayout:
    """Where peft put things in one model (FQNs of modules)."""

    prefix: str  # "base_model.model." (PeftModel) or "model." (a tuner such as LoraModel)
    layers: frozenset[str]  # tuner layers (LoRA-wrapped Linears, ...)
    lora_layers: frozenset[str]  # of them, LoRA layers
    wrappers: frozenset[str]  # modules_to_save wrappers

    @classmethod
    def of(cls, tree: ModuleTree) -> AdapterLayout | None:
        """The layout of a peft model, or None for any other model."""
        root = tree.root
        if root.is_a(PEFT_MODEL):
            prefix = "base_model.model."
        elif root.is_a(TUNER):
            prefix = "model."
        else:
            return None
        return cls(
            prefix=prefix,
            layers=frozenset(m.fqn for m in tree.modules if m.is_a(TUNER_LAYER)),
            lora_layers=frozenset(m.fqn for m in tree.modules if m.is_a(LORA_LAYER)),
            wrappers=frozenset(m.fqn for m in tree.modules if m.is_a(AUXILIARY)),
        )

    def checkpoint_key(self, name: str) -> str:
        """``name`` (a parameter or buffer of the peft model) as the base model's checkpoint
        names it: without the prefix, ``base_layer``, ``original_module`` and
        ``modules_to_save.<adapter>``. Adapters keep their own names (no checkpoint has them)."""
        parts = name.removeprefix(self.prefix).split(".") if name.startswith(self.prefix) else []
        if not parts:
            return name
        out: list[str] = []
        i = 0
        full = self.prefix.rstrip(".").split(".")
        while i < len(parts):
            here = ".".join(full)
            if here in self.layers and parts[i] == "base_layer":
                full.append(parts[i])
                i += 1
                continue
            if here in self.wrappers and parts[i] == "original_module":
                full.append(parts[i])
                i += 1
                continue
            if here in self.wrappers and parts[i] == "modules_to_save" and i + 1 < len(parts):
                full.extend(parts[i : i + 2])
                i += 2
                continue
            out.append(parts[i])
            full.append(parts[i])
            i += 1
        return ".".join(out)

    def is_adapter(self, name: str) -> bool:
        """Whether parameter ``name`` belongs to an adapter of a tuner layer (not its base)."""
        module = parent_fqn(name)
        while module:
            owner = parent_fqn(module)
            if owner in self.layers:
                return module.rpartition(".")[2] != "base_layer"
            if module in self.layers:
                return True  # a parameter registered on the layer itself (a scaling vector)
            module = owner
        return False

    def lora_factor(self, module: str) -> tuple[str, str, str] | None:
        """``(layer, "lora_A" or "lora_B", adapter)`` for a module ``<layer>.lora_A.<adapter>``
        of a LoRA layer; None for any other module."""
        container = parent_fqn(module)
        layer = parent_fqn(container)
        factor = container.rpartition(".")[2]
        if layer in self.lora_layers and factor in LORA_FACTORS:
            return layer, factor, module.rpartition(".")[2]
        return None

    def lora_visits(self, visits: Iterable[str]) -> tuple[str, ...]:
        """Of ``visits``, the LoRA factors (initialized as peft does, not by the base model's
        convention)."""
        return tuple(v for v in visits if self.lora_factor(v) is not None)

    def tensor_parallel(
        self, tree: ModuleTree, modules: tuple[tuple[str, str], ...], *, sequence: bool
    ) -> tuple[tuple[str, str], ...]:
        """The tp plan's ``(module, style)`` pairs with each wrapped layer's style moved onto
        what it wraps: a colwise layer's base layer and ``lora_B`` factors take its style (their
        outputs are added, both sharded on the last dim), its ``lora_A`` stay whole on every tp
        rank; a rowwise layer's base layer and ``lora_A`` factors take its style (both read the
        sharded input; ``lora_A``'s small output is all-reduced), its ``lora_B`` stay whole.
        Whatever else the plan asks of a peft layer is a ``ConfigError`` naming it."""
        out: list[tuple[str, str]] = []
        for fqn, style in modules:
            if fqn not in self.layers:
                out.append((fqn, style))
                continue
            kind = "colwise" if style.startswith("colwise") else style
            info = tree.module(fqn)
            refusal = _tp_refusal(tree, fqn, kind, sequence)
            if refusal:
                cls = info.class_name if info is not None else "a peft layer"
                raise ConfigError(
                    f"tensor parallelism over the peft layer {fqn!r} ({cls}, style "
                    f"{style!r}): {refusal}.",
                    subject=fqn,
                    hint="Leave the layer out of target_modules (LoRA on the others), or "
                    "train it without tp (strategy='fsdp', tp=1).",
                )
            out.append((f"{fqn}.base_layer", style))
            sharded = "lora_B" if kind == "colwise" else "lora_A"
            for m in tree.modules:
                if parent_fqn(m.fqn) == f"{fqn}.{sharded}":
                    out.append((m.fqn, style))
        return tuple(out)


def _tp_refusal(tree: ModuleTree, layer: str, kind: str, sequence: bool) -> str:
    """Why a wrapped layer cannot take a tp style, or "" when it can."""
    info = tree.module(layer)
    if info is None or not info.is_a(LORA_LAYER):
        return "fprep shards LoRA layers only, not other peft methods"
    if kind not in ("colwise", "rowwise"):
        return "LoRA layers take colwise and rowwise styles only"
    if sequence:
        return "sequence parallelism would feed its LoRA factors sequence-sharded DTensors"
    for m in tree.modules:
        if not m.fqn.startswith(f"{layer}."):
            continue
        rest = m.fqn[len(layer) + 1 :]
        if rest.startswith(("lora_embedding_", "lora_magnitude_vector")) and m.param_names:
            return "fprep shards LoRA factors of Linear layers only (no DoRA, no embeddings)"
        if rest.startswith("lora_dropout.") and m.is_a("Dropout"):
            return (
                "its lora_dropout would draw a different mask on each tp rank, so the factors "
                "kept whole on every tp rank would get different gradients and drift apart"
            )
        factor = rest.startswith(("lora_A.", "lora_B.")) and rest.count(".") == 1
        if factor and not m.is_a("Linear"):
            return f"its factor {m.fqn!r} is a {m.class_name}, not an nn.Linear"
    return ""
