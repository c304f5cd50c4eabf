"""`fprep plan` of Llama 3.1 405B as torchtitan runs it (512 ranks, PP8 x FSDP8 x TP8): time.

1. Runs the README's command (``fprep plan fprep.testing.models:llama_405b --world-size 512
   ... --pp 8 --pp-schedule Interleaved1F1B ... --batch 16 --seq-len 8192``) in a fresh
   process, as a user would, and times it end to end (imports included).
2. In this process, builds the model on the meta device once, then times ``fprep.plan`` plus
   ``fprep.estimate_memory(state, batch=...)`` for the first rank of each of the 8 pipeline
   ranks: what the command does for its per-pipeline-rank table (each plan covers that rank's
   part of the model only).

Target: seconds in all. ``--quick`` plans Llama 3 70B the same way (4 pipeline ranks, 128 ranks)
and runs the command once.

Usage: python benchmarks/plan_pipeline.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

FULL = {
    "builder": "llama_405b",
    "world": 512,
    "pp": 8,
    "microbatches": 16,
}
QUICK = {
    "builder": "llama_70b",
    "world": 128,
    "pp": 4,
    "microbatches": 8,
}


def command(case: dict[str, object]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fprep",
        "plan",
        f"fprep.testing.models:{case['builder']}",
        "--world-size",
        str(case["world"]),
        "--nproc-per-node",
        "8",
        "--tp",
        "8",
        "--pp",
        str(case["pp"]),
        "--pp-schedule",
        "Interleaved1F1B",
        "--pp-microbatches",
        str(case["microbatches"]),
        "--precision",
        "bf16",
        "--activation-checkpointing",
        "--batch",
        str(case["microbatches"]),
        "--seq-len",
        "8192",
    ]


def in_process(case: dict[str, object]) -> tuple[float, list[float]]:
    """Seconds to build the model, and to plan + estimate each pipeline rank's first rank."""
    import fprep
    from fprep.testing import models

    start = time.perf_counter()
    model = getattr(models, str(case["builder"]))()
    build = time.perf_counter() - start
    world, pp = int(str(case["world"])), int(str(case["pp"]))
    cfg = fprep.PrepConfig(
        strategy="fsdp",
        tp=8,
        pp=pp,
        pp_schedule="Interleaved1F1B",
        pp_microbatches=int(str(case["microbatches"])),
        wrap="LlamaBlock",
        precision="bf16",
        activation_checkpointing=True,
    )
    times = []
    for coordinate in range(pp):
        start = time.perf_counter()
        topology = fprep.Topology(
            world_size=world, rank=coordinate * world // pp, local_world_size=8
        )
        state = fprep.plan(model, cfg, topology).unwrap()
        fprep.estimate_memory(state, batch=(int(str(case["microbatches"])), 8192))
        times.append(time.perf_counter() - start)
    return build, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Llama 3 70B at 128 ranks, once")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the command (default 3)")
    args = parser.parse_args()
    case = QUICK if args.quick else FULL
    repeats = 1 if args.quick else args.repeats
    cli, cpu = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command(case), check=True, capture_output=True, text=True)
        cli.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    build, plans = in_process(case)
    print(f"{case['builder']} at {case['world']} ranks, pp {case['pp']} (Interleaved1F1B):")
    print(
        f"  fprep plan, end to end (fresh process)   median {statistics.median(cli):.2f} s "
        f"over {repeats} run(s): {', '.join(f'{t:.2f}' for t in cli)}"
    )
    print(f"  fprep plan, CPU time (user + system)      median {statistics.median(cpu):.2f} s")
    print(f"  build on meta (once)                      {build:.3f} s")
    print(
        f"  plan + estimate per pipeline rank         median {statistics.median(plans):.3f} s, "
        f"all {case['pp']}: {sum(plans):.3f} s"
    )


if __name__ == "__main__":
    main()
