"""The ``fprep`` command line: ``fprep plan``, ``fprep env`` and ``fprep demo``.

Errors are printed as one clear line (the ``PrepError`` message and hint) with exit status 2,
never as a traceback (fprep.cli_run).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, get_args

import torch
from returns.result import Failure

from fprep import demo
from fprep.cli_run import run_command
from fprep.config import Precision, PrepConfig, Sharding, Strategy
from fprep.errors import ConfigError
from fprep.memory import estimate_memory
from fprep.planning import plan
from fprep.policies import repeated_block_classes
from fprep.snapshot import ModuleTree
from fprep.state import PrepState
from fprep.summary import human_bytes
from fprep.topology import Topology, detect_device_type


def _load_builder(spec: str) -> Callable[[], Any]:
    """``package.module:function`` -> the function; the current directory is importable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"expected MODULE:BUILDER, got {spec!r}.",
            subject="builder",
            hint="For example: fprep plan mypkg.models:build_model --world-size 64",
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import {spec!r}: {e}.", subject="builder") from None
    if not callable(obj):
        raise ConfigError(f"{spec!r} is not callable.", subject="builder")
    return obj  # type: ignore[no-any-return]


def _build_on_meta(builder: Callable[[], Any]) -> torch.nn.Module:
    with torch.device("meta"):
        model = builder()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"the builder returned {type(model).__qualname__}, not an nn.Module.",
            subject="builder",
        )
    return model


#: What the per-rank total leaves out: a plan knows no batch, sequence length or allocator.
NOT_COUNTED = (
    "the units gathered during forward and backward (up to two the size of the largest at "
    "once, with prefetching)",
    "activations (they grow with batch size and sequence length)",
    "temporary buffers (collectives, allocator fragmentation, the CUDA context)",
)


def _memory_table(state: PrepState, async_checkpoint: bool = False) -> str:
    mem = estimate_memory(state, async_checkpoint=async_checkpoint)
    rows = [
        ("parameters", mem.params),
        ("gradients", mem.grads),
        ("Adam state", mem.adam),
        ("SGD momentum", mem.sgd_momentum),
        ("total (Adam)", mem.total("adam")),
        ("largest unit gathered", mem.largest_unit_unsharded),
    ]
    where = "host (offload)" if mem.on_host else "device"
    lines = [f"per-rank memory ({where}):"]
    if async_checkpoint:  # fprep.save(wait=False): a staged copy, always in host memory
        rows.append(("host: async staging max", mem.checkpoint_staging("adam")))
    lines += [f"  {name:<24}{human_bytes(value):>14}" for name, value in rows]
    lines += textwrap.wrap(
        "the total leaves out: " + "; ".join(NOT_COUNTED) + ".",
        width=96,
        initial_indent="  ",
        subsequent_indent="  ",
    )
    return "\n".join(lines)


def _plan_json(state: PrepState) -> dict[str, Any]:
    mem = estimate_memory(state)
    core = state.core
    handles = state.param_handles
    return {
        "world_size": state.topology.world_size,
        "rank": state.topology.rank,
        "strategy": core.strategy if core else None,
        "units": [u.fqn for u in handles.units] if handles else [],
        "nodes": state.topology.num_nodes,
        "nproc_per_node": state.topology.local_world_size,
        "memory_bytes": {**dataclasses.asdict(mem), "total_adam": mem.total("adam")},
        "total_leaves_out": list(NOT_COUNTED),
    }


def _check_nodes(args: argparse.Namespace) -> None:
    """hsdp's shard groups are the nodes: without ``--nproc-per-node`` the plan would assume one
    node of ``--world-size`` processes and quietly become a single shard group (plain fsdp)."""
    if args.strategy == "hsdp" and args.nproc_per_node is None:
        raise ConfigError(
            "--strategy hsdp needs --nproc-per-node: hsdp shards within a node and replicates "
            "across nodes, so the plan depends on how many processes each node runs.",
            subject="nproc_per_node",
            hint=f"Pass the processes per node, e.g. --world-size {args.world_size} "
            "--nproc-per-node 8.",
        )


def _one_node_note(args: argparse.Namespace) -> str | None:
    """Without ``--nproc-per-node`` the plan is for one node running every process: say so (on
    stderr, so that ``--json`` stays parseable), since a job of many ranks rarely is one."""
    if args.nproc_per_node is not None or args.world_size <= 1:
        return None
    return (
        f"fprep: note: no --nproc-per-node, so this plans one node running all "
        f"{args.world_size} processes (rank {args.rank} as local rank {args.rank}); pass "
        "--nproc-per-node with your nodes' process count (e.g. 8) for the real layout."
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    _check_nodes(args)
    model = _build_on_meta(_load_builder(args.builder))
    wrap = tuple(args.wrap) if args.wrap else repeated_block_classes(ModuleTree.of(model))
    cfg = PrepConfig(
        strategy=args.strategy,
        precision=args.precision,
        wrap=wrap or None,
        sharding=args.sharding,
        tp=args.tp,
        sequence_parallel=args.sequence_parallel,
        hsdp_shard_size=args.hsdp_shard_size,
    )
    topo = Topology(
        world_size=args.world_size,
        rank=args.rank,
        local_world_size=args.nproc_per_node or args.world_size,
        device_type=args.device_type,
    )
    result = plan(model, cfg, topo)
    if isinstance(result, Failure):
        raise result.failure()
    state = result.unwrap()
    note = _one_node_note(args)
    if note is not None:
        print(note, file=sys.stderr)
    if args.json:
        print(json.dumps(_plan_json(state), indent=2))
    else:
        print(state.summary())
        print(_memory_table(state, args.async_checkpoint))
    return 0


def _versions() -> dict[str, str]:
    """fprep's, Python's, torch's and (when installed) transformers' versions: what a bug report
    needs first. transformers is optional: left out when it cannot be found, and read from its
    package metadata, not imported (which takes seconds)."""
    import importlib.metadata
    import platform

    from fprep import __version__

    versions = {
        "fprep": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if importlib.util.find_spec("transformers") is not None:
        try:
            versions["transformers"] = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:  # importable, yet not installed
            versions["transformers"] = "(no package metadata)"
    return versions


def _cmd_env(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    launcher_vars = (
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "PMI_SIZE",
        "PMI_RANK",
    )
    info = {
        **_versions(),
        "device_type": detect_device_type(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "backends": {
            name: bool(available())
            for name, available in (
                ("gloo", dist.is_gloo_available),
                ("nccl", dist.is_nccl_available),
                ("mpi", dist.is_mpi_available),
            )
        },
        "launcher": {k: os.environ[k] for k in launcher_vars if k in os.environ},
        "topology": dataclasses.asdict(Topology.from_env()),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key:<12} {value}")
    return 0


DESCRIPTION = (
    "Plan a model for distributed and mixed-precision training without running it (fprep plan), "
    "show what this machine offers (fprep env), or train a small GPT end to end (fprep demo). "
    "Errors are printed as one line, with exit status 2."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fprep", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,env,demo}")

    p = sub.add_parser(
        "plan",
        help="plan a model built on the meta device; print per-rank memory",
        description="Build MODULE:BUILDER's model on the meta device (no memory), plan it for "
        "one rank of a job and print the plan and that rank's memory.",
    )
    p.add_argument("builder", help="MODULE:BUILDER, a function returning an nn.Module")
    p.add_argument("--world-size", type=int, default=1, help="processes in the job (default 1)")
    p.add_argument("--rank", type=int, default=0, help="the rank to plan for (default 0)")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="processes per node (default: all --world-size processes on one node); "
        "required with --strategy hsdp, whose shard groups are the nodes",
    )
    p.add_argument(
        "--device-type",
        default="cuda",
        help="device type of the job: cpu, cuda, hpu, xpu or mps (default cuda)",
    )
    p.add_argument(
        "--strategy",
        default="fsdp",
        help=f"one of {', '.join(get_args(Strategy))} (default fsdp)",
    )
    p.add_argument(
        "--sharding",
        default="full",
        help=f"for fsdp and hsdp: one of {', '.join(get_args(Sharding))} (default full)",
    )
    p.add_argument(
        "--precision",
        default="bf16",
        help=f"one of {', '.join(get_args(Precision))} (default bf16)",
    )
    p.add_argument(
        "--wrap",
        nargs="*",
        default=None,
        help="class names to wrap as units (default: the model's repeated blocks)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks (the innermost mesh dim; the model's own plan): the "
        "strategy shards or replicates over world-size / tp ranks (default 1)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: shard the norms' activations on the sequence (torchtitan's layout)",
    )
    p.add_argument(
        "--hsdp-shard-size",
        type=int,
        default=None,
        help="with --strategy hsdp: data-parallel ranks per shard group (default: a node's)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print strategy, units and memory bytes as JSON instead of the summary",
    )
    p.add_argument(
        "--async-checkpoint",
        action="store_true",
        help="add the most host memory fprep.save(wait=False)'s staged copy takes (with Adam)",
    )
    p.set_defaults(func=_cmd_plan)

    e = sub.add_parser(
        "env",
        help="versions (fprep, Python, torch, transformers), devices, backends, launcher variables",
        description="Print the versions of fprep, Python, torch and transformers (if installed), "
        "the devices, process-group backends, the launcher's "
        "variables and the topology fprep reads from them.",
    )
    e.add_argument("--json", action="store_true", help="print it as JSON")
    e.set_defaults(func=_cmd_env)

    d = sub.add_parser(
        "demo",
        help="prepare and train a small GPT on synthetic data (CPU; --nproc N ranks)",
        description=demo.DESCRIPTION,
    )
    demo.add_arguments(d)
    d.set_defaults(func=demo.run_from_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    raise SystemExit(main())
