"""`fprep plan` on a Llama-8B-shaped model at world size 64: time and truth.

1. Runs ``fprep plan fprep.testing.models:llama_8b --world-size 64 --rank R --json`` as a user
   would (a fresh process) and times it end to end.
2. In another fresh process, joins a fake process group of 64 ranks as rank R, builds the same
   model on the meta device, applies ``fully_shard`` per block and to the root exactly as a
   hand-written FSDP2 script does, and adds up the bytes FSDP2 allocates for this rank's sharded
   parameters (its padded flat storage per parameter).
3. Prints both figures and their ratio (target: equal within padding) and the command's time
   (target: a few seconds).

Usage: python benchmarks/plan_cli.py [--quick] [--rank R]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

WORLD = 64

FSDP_SCRIPT = """
import json, sys, torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from fprep.testing.models import llama_8b

world, rank = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
mesh = init_device_mesh("cpu", (world,))
model = llama_8b()  # meta device
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in model.layers:
    fully_shard(block, mesh=mesh, mp_policy=mp)
fully_shard(model, mesh=mesh, mp_policy=mp)
allocated = unpadded = 0
for module in model.modules():
    state = fully_shard.state(module) if hasattr(fully_shard, "state") else None
    group = getattr(state, "_fsdp_param_group", None) if state is not None else None
    for fp in getattr(group, "fsdp_params", []) or []:
        data = fp._sharded_param_data
        allocated += data.numel() * data.element_size()
        local = fp.sharded_param.to_local()
        unpadded += local.numel() * local.element_size()
print(json.dumps({"allocated": allocated, "unpadded": unpadded}))
dist.destroy_process_group()
"""


def run(cmd: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one timing run instead of three")
    parser.add_argument("--rank", type=int, default=37, help="the rank to plan (default 37)")
    args = parser.parse_args(argv)
    cli = [
        sys.executable,
        "-m",
        "fprep.cli",
        "plan",
        "fprep.testing.models:llama_8b",
        "--world-size",
        str(WORLD),
        "--rank",
        str(args.rank),
        "--strategy",
        "fsdp",
        "--precision",
        "bf16",
        "--json",
    ]
    times = []
    report: dict[str, object] = {}
    for _ in range(1 if args.quick else 3):
        seconds, out = run(cli)
        times.append(seconds)
        report = json.loads(out)
    _, out = run([sys.executable, "-c", FSDP_SCRIPT, str(WORLD), str(args.rank)])
    truth = json.loads(out)
    memory = report["memory_bytes"]
    assert isinstance(memory, dict)
    planned = int(memory["params"])
    print(f"fprep plan, Llama-8B shape, fsdp bf16, world {WORLD}, rank {args.rank}")
    median = sorted(times)[len(times) // 2]
    print(f"  command wall time (fresh process, median of {len(times)}): {median:.2f} s")
    print(f"  plan: per-rank parameter bytes         {planned:>14,}")
    print(f"  fully_shard allocates (padded shards)  {truth['allocated']:>14,}")
    print(f"  fully_shard local (unpadded) shards    {truth['unpadded']:>14,}")
    print(f"  plan / allocated = {planned / truth['allocated']:.6f} (target 1.0 within padding)")


if __name__ == "__main__":
    main()
