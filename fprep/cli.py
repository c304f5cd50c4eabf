"""The ``fprep`` command line: ``fprep plan``, ``fprep env``, ``fprep demo`` and ``--version``.

Errors are printed as one clear line (the ``PrepError`` message and hint) with exit status 2,
never as a traceback (fprep.cli_run). How ``fprep plan`` builds the model it is named is
fprep.cli_model; what it prints about the plan, fprep.cli_report.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import get_args

import torch
from returns.result import Failure

from fprep import demo
from fprep.cli_model import FORMS, build_model
from fprep.cli_report import memory_table, pipeline_json, pipeline_table, plan_json
from fprep.cli_run import run_command
from fprep.config import PipelineSchedule, Precision, PrepConfig, Sharding, Strategy
from fprep.errors import ConfigError, need
from fprep.memory import estimate_memory
from fprep.planning import plan
from fprep.policies import repeated_block_classes
from fprep.snapshot import ModuleTree
from fprep.state import PrepState
from fprep.topology import LAUNCHER_VARIABLES, Topology, detect_device_type


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


def _batch(args: argparse.Namespace) -> tuple[int, int] | None:
    """``(--batch, --seq-len)``: both or neither."""
    if args.batch is None and args.seq_len is None:
        return None
    if args.batch is None or args.seq_len is None:
        given, missing = (
            ("--batch", "--seq-len") if args.seq_len is None else ("--seq-len", "--batch")
        )
        raise ConfigError(
            f"{given} without {missing}: the activations need both the rows and the sequence "
            "length.",
            subject=missing.removeprefix("--").replace("-", "_"),
            hint="Pass both, e.g. --batch 8 --seq-len 4096 (rows per data-parallel rank).",
        )
    for name, value in (("batch", args.batch), ("seq_len", args.seq_len)):
        if value < 1:
            raise ConfigError(
                f"--{name.replace('_', '-')} {value}: it must be at least 1.",
                subject=name,
                hint="Give the rows per data-parallel rank and the tokens per row.",
            )
    return int(args.batch), int(args.seq_len)


def _planned(model: torch.nn.Module, cfg: PrepConfig, topo: Topology) -> PrepState:
    result = plan(model, cfg, topo)
    if isinstance(result, Failure):
        raise result.failure()
    return result.unwrap()


def _pipeline_states(
    model: torch.nn.Module, cfg: PrepConfig, topo: Topology, state: PrepState
) -> list[PrepState]:
    """The plan of each pipeline rank's first rank, in pipeline order (the pp dimension is the
    outermost: pipeline rank ``c`` starts at flat position ``c x world / pp``). One plan each,
    of that rank's part of the model: never the whole world."""
    mesh = need(state.process_group, "init_process_group", "fprep plan").mesh
    stride = mesh.size // mesh.pp
    states = []
    for coordinate in range(mesh.pp):
        rank = mesh.global_rank(coordinate * stride)
        same = rank == topo.rank
        states.append(state if same else _planned(model, cfg, replace(topo, rank=rank)))
    return states


def _cmd_plan(args: argparse.Namespace) -> int:
    _check_nodes(args)
    batch = _batch(args)
    notes: list[str] = []
    model = build_model(args.model, notes=notes)
    wrap = tuple(args.wrap) if args.wrap else repeated_block_classes(ModuleTree.of(model))
    cfg = PrepConfig(
        strategy=args.strategy,
        precision=args.precision,
        wrap=wrap or None,
        sharding=args.sharding,
        tp=args.tp,
        sequence_parallel=args.sequence_parallel,
        hsdp_shard_size=args.hsdp_shard_size,
        pp=args.pp,
        pp_schedule=args.pp_schedule,
        pp_microbatches=args.pp_microbatches,
        activation_checkpointing=args.activation_checkpointing,
    )
    topo = Topology(
        world_size=args.world_size,
        rank=args.rank,
        local_world_size=args.nproc_per_node or args.world_size,
        device_type=args.device_type,
    )
    state = _planned(model, cfg, topo)
    stages = _pipeline_states(model, cfg, topo, state) if state.pipeline is not None else None
    if batch is not None:  # a batch the plan cannot split fails here, before any output
        estimate_memory(state, batch=batch)
    one_node = _one_node_note(args)
    for note in (*notes, *([one_node] if one_node else [])):
        print(note if note.startswith("fprep: ") else f"fprep: note: {note}", file=sys.stderr)
    if args.json:
        data = plan_json(state, args.async_checkpoint, batch)
        data["pipeline"] = pipeline_json(stages, batch) if stages else None
        print(json.dumps(data, indent=2))
    else:
        print(state.summary())
        print(memory_table(state, args.async_checkpoint, batch))
        if stages:
            print(pipeline_table(stages, batch))
    return 0


def fprep_version() -> str:
    """The installed distribution's version (its package metadata); ``fprep.__version__`` where
    fprep runs from a source tree that was never installed."""
    try:
        return importlib.metadata.version("fprep")
    except importlib.metadata.PackageNotFoundError:
        from fprep import __version__

        return __version__


def _versions() -> dict[str, str]:
    """fprep's, Python's, torch's and (when installed) transformers' versions: what a bug report
    needs first. transformers is optional: left out when it cannot be found, and read from its
    package metadata, not imported (which takes seconds)."""
    import platform

    versions = {
        "fprep": fprep_version(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if importlib.util.find_spec("transformers") is not None:
        try:
            versions["transformers"] = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:  # importable, yet not installed
            versions["transformers"] = "(no package metadata)"
    return versions


#: Per launcher (as ``Topology.from_env`` reads them): the world-size variable and the
#: processes-per-node one.
_LOCAL_SIZE_VARS = (
    ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "torchrun sets it; export it with your own launcher"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun sets it"),
    ("PMI_SIZE", "MPI_LOCALNRANKS", "mpiexec sets it"),
)


def launch_warnings(env: Mapping[str, str]) -> list[str]:
    """What a distributed launch (world size above 1) is missing: the processes-per-node count
    (without it fprep assumes one node of every process) and the rendezvous address."""
    topology = Topology.from_env(env, device_type="cpu")
    if topology.world_size <= 1:
        return []
    warnings = []
    world_var, local_var, who = next(
        (w, local, who) for w, local, who in _LOCAL_SIZE_VARS if w in env
    )
    if local_var not in env:
        warnings.append(
            f"{world_var}={topology.world_size} but {local_var} is not set, so fprep assumes "
            f"one node running all {topology.world_size} processes (rank {topology.rank} uses "
            f"local rank {topology.local_rank}). Set {local_var} to the processes per node "
            f"({who}), or launch with torchrun --nproc-per-node N."
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        warnings.append(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set, so the "
            f"{topology.world_size} processes have no address to meet at. Set MASTER_ADDR to "
            "rank 0's host and MASTER_PORT to a free port on every process (torchrun sets "
            "both; with mpirun, export them: -x MASTER_ADDR -x MASTER_PORT)."
        )
    return warnings


def _cmd_env(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    topology = Topology.from_env()
    warnings = launch_warnings(os.environ)
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
        "launcher": {k: os.environ[k] for k in LAUNCHER_VARIABLES if k in os.environ},
        "topology": dataclasses.asdict(topology),
        "warnings": warnings,
    }
    for warning in warnings:  # on stderr: --json's standard output stays JSON
        print(f"fprep: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            if key != "warnings":
                print(f"{key:<12} {value}")
    return 0


DESCRIPTION = (
    "Plan a model for distributed and mixed-precision training without running it (fprep plan), "
    "show what this machine offers (fprep env), or train a small GPT end to end (fprep demo). "
    "Errors are printed as one line, with exit status 2 (an internal error too; --debug or "
    "FPREP_DEBUG=1 adds its traceback)."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fprep", description=DESCRIPTION)
    parser.add_argument(
        "--version", action="version", version=f"fprep {fprep_version()}", help="print the version"
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback of an internal error (a bug in fprep), as FPREP_DEBUG=1 does",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,env,demo}")

    p = sub.add_parser(
        "plan",
        help="plan a model built on the meta device; print per-rank memory",
        description="Build a model on the meta device (no memory, no weights), plan it for "
        "one rank of a job and print the plan and that rank's memory. " + FORMS + " A "
        "config.json is built by transformers in float32, as a model not yet downloaded.",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="MODULE:BUILDER or FILE.py:BUILDER (a function taking no arguments and returning "
        "an nn.Module), or a transformers config.json or a directory holding one",
    )
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
        "--pp",
        type=int,
        default=1,
        help="pipeline ranks (the outermost mesh dim; the model's own pipeline plan splits it): "
        "prints one line per pipeline rank (default 1)",
    )
    p.add_argument(
        "--pp-schedule",
        default="1F1B",
        help=f"with --pp: one of {', '.join(get_args(PipelineSchedule))} (default 1F1B)",
    )
    p.add_argument(
        "--pp-microbatches",
        type=int,
        default=None,
        help="with --pp: micro-batches per step (default: one per stage)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        metavar="ROWS",
        help="rows each data-parallel rank trains per step (with --seq-len): adds the "
        "activations kept for backward at the peak",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="N",
        help="tokens per row (with --batch)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="checkpoint each wrapped block: it keeps only its input for backward",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the plan as JSON instead of the summary: everything the summary shows "
        "(mesh, tensor parallelism, precision, units, ...) and the memory in bytes",
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
        "variables and the topology fprep reads from them. When the world size is above 1, "
        "warn (on stderr) about a missing processes-per-node count or MASTER_ADDR / "
        "MASTER_PORT.",
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
