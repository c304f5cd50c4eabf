"""``PrepState``: every decision of a preparation, as frozen, hashable, comparable data.

The state starts from its inputs (module tree, topology, config, and a snapshot of any process
group or mesh the user passed) and gains one sub-state per ``init_*`` transition. Sub-states are
``None`` until their transition ran; a transition that needs one that is missing returns a
``PlanOrderError`` failure. Handles (process groups, meshes, the model) are never stored here:
the prepare steps keep them in a separate runtime object, so plans stay comparable.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from fprep.config import PrepConfig
from fprep.errors import ModelError
from fprep.errors import need as need  # defined beside PlanOrderError, used with sub-states
from fprep.layout.mesh import MeshPlan
from fprep.layout.placements import Placement
from fprep.snapshot import ModuleTree
from fprep.topology import Topology
from fprep.weights.records import WeightsPlan, WeightsSnapshot

T = TypeVar("T")

ResolvedStrategy = Literal["none", "ddp", "fast_ddp", "fsdp", "hsdp"]


# -- snapshots of handles the user may pass ------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """A process group as data: its size and this process's rank in it."""

    size: int
    rank: int
    ranks: tuple[int, ...] | None = None  # global ranks of the members, when known


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """A DeviceMesh as data.

    ``shape`` / ``dim_names`` / ``coordinate`` describe the mesh given for data parallelism;
    ``root_shape`` / ``root_dim_names`` the mesh it was sliced from (equal when not a slice).
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None = None
    coordinate: tuple[int, ...] = ()
    ranks: tuple[int, ...] | None = None  # global ranks, row-major; None means range(size)
    root_shape: tuple[int, ...] | None = None
    root_dim_names: tuple[str, ...] | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_slice(self) -> bool:
        return self.root_shape is not None and self.root_shape != self.shape


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    tree: ModuleTree
    topology: Topology
    config: PrepConfig
    process_group: GroupSpec | None = None
    mesh: MeshSpec | None = None
    weights: WeightsSnapshot | None = None  # headers of PrepConfig.weights' files


# -- one sub-state per transition ----------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ProcessGroupState:
    """Who shards with whom. For 1-D worlds the shard group is the data-parallel group.

    ``mesh`` is the whole N-D mesh as one record; the other attributes are read from it (the
    data-parallel mesh FSDP2 / DDP receive, and its groups), never stored beside it.
    """

    mesh: MeshPlan
    gradient_predivide_factor: float
    gradient_postdivide_factor: float

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The data-parallel mesh's shape."""
        return self.mesh.dp_mesh_shape

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return self.mesh.dp_mesh_names

    @property
    def coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate on the data-parallel mesh."""
        return self.mesh.dp_coordinate

    @functools.cached_property
    def shard_group(self) -> tuple[int, ...]:
        """Ranks this rank shards parameters with (intra-node for hsdp); computed once."""
        return self.mesh.shard_group

    @functools.cached_property
    def replicate_group(self) -> tuple[int, ...]:
        """Ranks holding the same shard (inter-node for hsdp); computed once."""
        return self.mesh.same_shard_ranks

    @property
    def shard_size(self) -> int:
        return len(self.shard_group)

    @functools.cached_property
    def shard_rank(self) -> int:
        """This rank's index in its shard group (looked up once; the group may be large)."""
        return self.shard_group.index(self.rank)

    @property
    def replicate_size(self) -> int:
        return len(self.replicate_group)


@dataclass(frozen=True, kw_only=True)
class PipelineState:
    """Pipeline parallelism: the model cut into stages, and the stages this rank runs.

    ``split`` lists the module FQNs of every stage, first stage first (each module in exactly
    one stage); ``stages`` are this rank's stage indices (one, two for the V schedules, or
    ``pp_stages_per_rank`` round-robin for the looped ones). ``shared`` are the modules without
    parameters that no stage names (rotary embeddings, dropouts): every stage keeps them.
    ``whole`` is the snapshot of the whole model; from ``init_pipeline`` on, ``inputs.tree`` is
    this rank's part of it (its stages' modules under their own names, a pass-through in place
    of every other stage's module), so every later transition plans this rank's part only.
    ``mesh`` is the mesh record (``ProcessGroupState.mesh``); the pipeline ranks are its ``pp``
    dimension.
    """

    mesh: MeshPlan
    schedule: str
    microbatches: int
    split: tuple[tuple[str, ...], ...]
    stages: tuple[int, ...]
    source: Literal["config", "model"]
    shared: tuple[str, ...] = ()
    whole: ModuleTree | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        """The pipeline ranks."""
        return self.mesh.pp

    @property
    def rank(self) -> int:
        """This rank's index among the pipeline ranks."""
        return self.mesh.coordinate("pp")

    @property
    def num_stages(self) -> int:
        return len(self.split)

    @property
    def holds_first(self) -> bool:
        """This rank runs stage 0 (it is fed the inputs)."""
        return 0 in self.stages

    @property
    def holds_last(self) -> bool:
        """This rank runs the last stage (it is given the targets and computes the loss)."""
        return self.num_stages - 1 in self.stages

    @property
    def modules(self) -> tuple[str, ...]:
        """The split's modules this rank holds, in stage order."""
        return tuple(name for index in self.stages for name in self.split[index])

    def elsewhere(self, part: ModuleTree) -> dict[str, tuple[int, ...]]:
        """The whole model's parameter and persistent-buffer names that other stages hold
        (not in ``part``, this rank's part of the model), with their shapes."""
        whole = self.whole if self.whole is not None else part
        mine = {n for p in part.params for n in p.names} | {b.fqn for b in part.buffers}
        out = {n: p.shape for p in whole.params for n in p.names if n not in mine}
        out.update({b.fqn: b.shape for b in whole.buffers if b.persistent and b.fqn not in mine})
        return out

    def gaps(self, stage: int | None = None) -> tuple[str, ...]:
        """The split's modules a pass-through stands in for: on stage ``stage``'s module, or
        on this rank's part when ``stage`` is None."""
        held = set(self.split[stage]) if stage is not None else set(self.modules)
        return tuple(name for names in self.split for name in names if name not in held)


@dataclass(frozen=True, kw_only=True)
class IgnoredState:
    modules: frozenset[str]  # closed under submodules
    params: frozenset[str]  # every name of every ignored parameter
    buffers: frozenset[str]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class DeviceState:
    device_type: str
    compute_device: str  # e.g. "cpu", "cuda:3", "hpu"
    source: Literal["config", "parameters", "accelerator", "cpu"]
    backend: str  # process-group backend for this device type (gloo, nccl, hccl, xccl)
    param_devices: tuple[str, ...]  # distinct devices the managed parameters are on now


@dataclass(frozen=True, kw_only=True)
class BufferState:
    dtypes: tuple[tuple[str, str], ...]  # (buffer FQN, original dtype), sorted by FQN

    def as_dict(self) -> dict[str, str]:
        return dict(self.dtypes)


@dataclass(frozen=True, kw_only=True)
class Fp8Plan:
    """Which Linear layers run in float8 (``precision="fp8"``), and why the others do not."""

    recipe: str  # torchao's recipe name ("tensorwise", "rowwise", ...)
    modules: tuple[str, ...]  # Linear FQNs swapped for float8 ones
    kept: tuple[tuple[str, str], ...]  # (Linear FQN, why it stays in high precision)
    fsdp_float8_all_gather: bool  # FSDP2 all-gathers these weights in float8


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """Dtypes by role. ``None`` means "leave as is" (fp32 training)."""

    param_dtype: str | None = None  # compute dtype of parameters (FSDP all-gather dtype)
    reduce_dtype: str | None = None  # gradient reduction dtype
    output_dtype: str | None = "float32"  # what forward returns
    autocast_dtype: str | None = None  # autocast region dtype (every strategy)
    grad_scaling: bool = False  # fp16 needs a gradient scaler
    fp8: bool = False
    fp8_plan: Fp8Plan | None = None  # set with fp8


@dataclass(frozen=True, kw_only=True)
class CoreState:
    requested_strategy: str
    strategy: ResolvedStrategy
    reshard_after_forward: bool | int
    precision: PrecisionPolicy
    offload: Literal["none", "cpu"]
    pin_memory: bool
    training_state: Literal["idle"] = "idle"
    notes: tuple[str, ...] = ()

    @property
    def is_sharded(self) -> bool:
        return self.strategy in ("fsdp", "hsdp")

    @property
    def is_distributed(self) -> bool:
        """Whether a data-parallel engine (DDP, fast_ddp, FSDP2) runs: the model has
        data-parallel peers. Whether the run has several processes is another question, read
        from the mesh record (``ProcessGroupState.mesh.is_distributed``): tensor or pipeline
        parallelism without data parallelism resolves the strategy to ``"none"``."""
        return self.strategy != "none"


@dataclass(frozen=True, kw_only=True)
class RuntimeState:
    sync_gradients: bool
    comm_hook: str  # "none", "fp16", "bf16", "bf16_gloo" (our path on gloo), "powersgd"
    ddp_kwargs: tuple[tuple[str, object], ...]
    fast_ddp_dtype: str | None  # fused all-reduce buffer dtype when strategy is fast_ddp
    fast_ddp_scale: float | None  # 1 / world size


@dataclass(frozen=True, kw_only=True)
class TensorParallelState:
    """Tensor parallelism: the tp dimension of the mesh and what each style does.

    ``mesh`` is the mesh record ``init_process_group`` planned (the same object as
    ``ProcessGroupState.mesh``); this rank's tp size, rank and group, and the mesh the
    DeviceMesh is built with, are read from it, never stored beside it. tp is its innermost
    dimension (torchtitan's and Accelerate's order), so over the whole world rank ``r`` is tp
    rank ``r % size`` of the group ``[r - r % size, r - r % size + size)``.

    ``modules``: ``(module FQN, style name)`` in pre-order; ``params``:
    ``(parameter FQN, tp shard dim or None when replicated)`` for every
    parameter of those modules (they become DTensors over the tp dimension). ``float8``:
    ``(module FQN, torch / torchao style class)`` for every module the fp8 plan converts and
    the tp plan shards: torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` with
    tensorwise scales (inputs cast to float8 on DTensors, amax all-reduced over tp), torch's
    ``ColwiseParallel`` / ``RowwiseParallel`` with a rowwise recipe (torchao's float8 styles
    cast tensorwise only; the float8 matmuls then run on each rank's shard).
    """

    mesh: MeshPlan
    modules: tuple[tuple[str, str], ...]
    params: tuple[tuple[str, int | None], ...]
    plan_source: Literal["config", "model"]
    loss_parallel: bool = False  # the output stays vocabulary-sharded (fprep.loss_parallel)
    notes: tuple[str, ...] = ()
    float8: tuple[tuple[str, str], ...] = ()
    #: every tp parameter's layout over the tp ranks (``params`` gives just its dim):
    #: ``Shard(d)``, ``StridedShard(d, 2)`` (packed halves, each cut on its own) or
    #: ``Replicate()`` (a DTensor kept whole on every tp rank)
    placements: tuple[tuple[str, Placement], ...] = ()
    #: the rules that name a parameter rather than a module ``(parameter FQN, style)``
    param_rules: tuple[tuple[str, str], ...] = ()
    #: the rope part of a multi-head latent attention kv_a projection (``qk_rope_head_dim``),
    #: which ``mla_kv_a_proj`` splits off
    rope_dim: int | None = None

    @property
    def size(self) -> int:
        """How many ranks split each planned tensor (the mesh's ``tp``)."""
        return self.mesh.tp

    @property
    def rank(self) -> int:
        """This rank's index in its tp group."""
        return self.mesh.coordinate("tp")

    @functools.cached_property
    def group(self) -> tuple[int, ...]:
        """The global ranks this rank splits tensors with, in tp order; computed once."""
        return self.mesh.tp_group

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The shape of the DeviceMesh tensor parallelism runs on: the data-parallel mesh's
        dimensions, then ``tp``."""
        return (*self.mesh.dp_mesh_shape, self.mesh.tp)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The names of ``mesh_shape``'s dimensions (the data-parallel mesh's, then ``"tp"``)."""
        return (*self.mesh.dp_mesh_names, "tp")

    def dim_of(self, fqn: str) -> tuple[bool, int | None]:
        """(whether ``fqn`` is a tp DTensor, the dim it is sharded on over tp)."""
        for name, dim in self.params:
            if name == fqn:
                return True, dim
        return False, None


@dataclass(frozen=True, kw_only=True)
class ExtensionState:
    """What runs on the mesh's dimensions beyond data parallelism: tensor parallelism planned
    by fprep (``tensor_parallel``; ``None`` without it).

    The mesh itself is ``ProcessGroupState.mesh``, never described here again. Later
    dimensions (pipeline, context parallel) enter the same way: a sub-record per dimension,
    planned before ``init_param_handles`` computes each parameter's local block.
    """

    tensor_parallel: TensorParallelState | None = None


@dataclass(frozen=True, kw_only=True)
class StateDictState:
    type: Literal["sharded", "full"]
    cpu_offload: bool
    full_on_rank0_only: bool  # full state dicts are gathered on rank 0 only
    broadcast_from_rank0: bool  # full loads read on rank 0 and broadcast
    weights: WeightsPlan | None = None  # what this rank reads of PrepConfig.weights


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """One managed parameter and what this rank holds of it."""

    fqn: str
    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str  # storage dtype of the (sharded) parameter
    local_shape: tuple[int, ...]  # this rank's unpadded shard
    padded_shape: tuple[int, ...]  # this rank's allocation (padded to an even chunk)
    requires_grad: bool
    #: Under tensor parallelism: the mesh dims the parameter's DTensor spans and its placement
    #: on each, as typed values (``fprep.layout.placements``: ``Shard(0)``,
    #: ``StridedShard(0, 2)``, ``Replicate()``; ``str`` gives torch's repr, and
    #: ``fprep.apply.placements.to_torch`` torch's object); empty otherwise.
    mesh_dims: tuple[str, ...] = ()
    placements: tuple[Placement, ...] = ()
    tp_shape: tuple[int, ...] = ()  # the tensor-parallel block FSDP2 shards (and gathers)

    @property
    def numel(self) -> int:
        return _prod(self.shape)

    @property
    def local_numel(self) -> int:
        return _prod(self.local_shape)

    @property
    def padded_numel(self) -> int:
        return _prod(self.padded_shape)

    @property
    def gathered_numel(self) -> int:
        """Elements FSDP2's all-gather rebuilds: the tp block under tensor parallelism."""
        return _prod(self.tp_shape) if self.tp_shape else self.numel


@dataclass(frozen=True, kw_only=True)
class WrapUnit:
    """A module that gets its own FSDP parameter group (or checkpoint / compile region)."""

    fqn: str
    cls: str
    params: tuple[ShardSpec, ...]
    reshard_after_forward: bool | int

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass(frozen=True, kw_only=True)
class MaterializePlan:
    """How meta-device parameters become real: which modules, and by what.

    ``method``, in order of precedence: ``param_init_fn`` (``PrepConfig``; a bound
    ``_init_weights`` of a Hugging Face model counts as that model's own convention,
    ``hf_init_weights``), the model's own convention (``hf_init_weights``: a transformers
    ``PreTrainedModel``'s ``_init_weights``, walked as ``initialize_weights`` walks it;
    ``init_weights``: a root with torchtitan's ``init_weights()``), then ``reset_parameters``
    (each module holding meta tensors). ``modules``: the modules holding meta tensors (allocated);
    ``visits``: the modules whose init runs, in the order it runs (children before parents,
    except ``reset_parameters``, in plan order); ``owners``: for ``hf_init_weights``, per visit,
    the ``PreTrainedModel`` whose ``_init_weights`` runs on it (None: see ``outside``).
    ``outside``: what a visit outside every ``PreTrainedModel`` runs: ``bound``, the bound
    ``param_init_fn``'s model's ``_init_weights``; ``reset_parameters``, the module's own (a
    plain model around Hugging Face sub-models, e.g. a backbone with a custom head).
    ``unavailable``: why nothing can initialize some module (the plan still stands and notes it;
    ``prepare`` refuses it before any effect). ``lora``: of ``visits``, the LoRA factors of a
    peft model (``<layer>.lora_A.<adapter>``, ``<layer>.lora_B.<adapter>``), initialized as
    peft initializes them whatever ``method`` says (``fprep.apply.lora_init``).
    """

    method: Literal["none", "param_init_fn", "hf_init_weights", "init_weights", "reset_parameters"]
    modules: tuple[str, ...] = ()
    visits: tuple[str, ...] = ()
    owners: tuple[str | None, ...] = ()
    outside: Literal["bound", "reset_parameters"] = "bound"
    unavailable: Unavailable | None = None
    #: Of ``modules``, those whose parameters and buffers all come from ``PrepConfig.weights``:
    #: allocated, but not initialized (``load_weights`` fills them).
    loaded: tuple[str, ...] = ()
    lora: tuple[str, ...] = ()

    @property
    def notes(self) -> tuple[str, ...]:
        if self.unavailable is None:
            return ()
        return (f"cannot prepare: {self.unavailable.message}",)

    def check(self) -> None:
        """Raise the ``ModelError`` for ``unavailable`` (``prepare`` does, before any effect)."""
        u = self.unavailable
        if u is not None:
            raise ModelError(u.message, subject=u.subject, hint=u.hint)


@dataclass(frozen=True, kw_only=True)
class Unavailable:
    """A module nothing can initialize: the ``ModelError`` ``prepare`` raises, as data."""

    message: str
    subject: str
    hint: str


@dataclass(frozen=True, kw_only=True)
class ParamHandleState:
    units: tuple[WrapUnit, ...]  # application order: inner units first, the root last
    ignored: tuple[ShardSpec, ...]  # ignored parameters: full copy on every rank
    materialize: MaterializePlan

    def unit(self, fqn: str) -> WrapUnit | None:
        return next((u for u in self.units if u.fqn == fqn), None)

    @property
    def specs(self) -> tuple[ShardSpec, ...]:
        return tuple(p for u in self.units for p in u.params)


@dataclass(frozen=True, kw_only=True)
class PrefetchState:
    """Explicit prefetch lists: unit FQN -> the units it prefetches."""

    forward: tuple[tuple[str, tuple[str, ...]], ...]
    backward: tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True, kw_only=True)
class PrepState:
    """The complete, frozen plan. ``fprep.plan`` returns it; ``prepare`` applies it."""

    inputs: PlanInputs
    process_group: ProcessGroupState | None = None
    #: set by ``init_pipeline`` when ``PrepConfig.pp > 1``; None otherwise
    pipeline: PipelineState | None = None
    ignored: IgnoredState | None = None
    device: DeviceState | None = None
    buffers: BufferState | None = None
    core: CoreState | None = None
    runtime: RuntimeState | None = None
    extension: ExtensionState | None = None
    state_dict: StateDictState | None = None
    param_handles: ParamHandleState | None = None
    prefetching: PrefetchState | None = None
    applied: tuple[str, ...] = ()  # names of the prepare steps that ran, in order
    skipped: tuple[str, ...] = ()  # of those, the ones with nothing to do for this plan
    #: Live handles (device, mesh, process group, grad scaler) set by the prepare steps; not
    #: data, so excluded from equality, hashing and repr (see fprep.apply.steps.Handles).
    handles: object = field(default=None, compare=False, repr=False)

    @classmethod
    def initial(
        cls,
        tree: ModuleTree,
        config: PrepConfig,
        topology: Topology | None = None,
        *,
        process_group: GroupSpec | None = None,
        mesh: MeshSpec | None = None,
        weights: WeightsSnapshot | None = None,
    ) -> PrepState:
        return cls(
            inputs=PlanInputs(
                tree=tree,
                topology=topology or Topology(),
                config=config,
                process_group=process_group,
                mesh=mesh,
                weights=weights,
            )
        )

    # shorthands
    @property
    def tree(self) -> ModuleTree:
        return self.inputs.tree

    @property
    def config(self) -> PrepConfig:
        return self.inputs.config

    @property
    def topology(self) -> Topology:
        return self.inputs.topology

    @property
    def tensor_parallel(self) -> TensorParallelState | None:
        """The planned tensor parallelism; ``None`` without it (or before ``init_extension``)."""
        return self.extension.tensor_parallel if self.extension is not None else None

    @property
    def is_complete(self) -> bool:
        return all(getattr(self, name) is not None for name in SUBSTATES)

    def replace(self, **changes: object) -> PrepState:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def summary(self) -> str:
        from fprep.summary import summarize

        return summarize(self)

    def __repr__(self) -> str:
        done = [n for n in SUBSTATES if getattr(self, n) is not None]
        core = self.core
        strategy = core.strategy if core else self.config.strategy
        return (
            f"PrepState(strategy={strategy!r}, world_size={self.topology.world_size}, "
            f"rank={self.topology.rank}, modules={len(self.tree.modules)}, "
            f"params={len(self.tree.params)}, planned={done}, applied={list(self.applied)})"
        )


#: Sub-state field names in pipeline order.
SUBSTATES: tuple[str, ...] = (
    "process_group",
    "ignored",
    "device",
    "buffers",
    "core",
    "runtime",
    "extension",
    "state_dict",
    "param_handles",
    "prefetching",
)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
