"""Simulated-cluster speed: wall time to serve 100,000 requests on 64 simulated replicas (each its own real
scheduler, policy and allocator) behind a router, at a rate the cluster keeps up with and with every request
arriving at once (overloaded: the waiting queues hold ~1,500 requests per replica at the start).

    python experiments/bench_cluster_sim.py [--replicas 64] [--requests 100000] [--routers round_robin,...]
                                            [--rate 2000] [--out experiments/results/bench_cluster_sim.md]

The workload is bench_sim.py's (prompts 128 +- 50%, outputs 16 +- 50% tokens, Poisson arrivals), the step
times the shipped bfloat16 profile's (named, so that a machine's own cached profile does not replace it), 64 sequences and 1,024 KV blocks per replica; nothing is written to disk
but the table. Wall time covers building the replicas, generating the workload and serving it, in this one
process (``time.perf_counter``); CPU time is the process's (``time.process_time``): on a shared machine their
ratio shows how much of the wall time the process had a core.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nanovllm import machine
from nanovllm.cluster.config import ClusterConfig
from nanovllm.config import EngineConfig
from nanovllm.harness.cluster import ServedCluster
from nanovllm.harness.sim.step_time import shipped_profile
from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, generate_workload

ROOT = Path(__file__).resolve().parent.parent


def one_run(replicas: int, requests: int, rate: float, router: str) -> dict[str, float]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    runner = {"name": "sim", "step_time": "calibrated", "profile": str(shipped_profile("bfloat16"))}
    served = ServedCluster.simulated(ClusterConfig(replicas=replicas), router, runner, None,
                                     EngineConfig(num_kv_blocks=1024, max_num_seqs=64, dtype="bfloat16"))
    workload = generate_workload(SyntheticWorkloadConfig(
        num_requests=requests, request_rate=rate, seed=0,
        input_len=LengthDist(kind="uniform", mean=128, range_ratio=0.5),
        output_len=LengthDist(kind="uniform", mean=16, range_ratio=0.5)), served.engine.tokenizer)
    built = time.perf_counter()
    result = served.serve(workload)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    done = sum(r["error"] is None for r in result.requests)
    return {"wall_s": wall, "cpu_s": cpu, "serve_s": time.perf_counter() - built, "steps": len(result.steps),
            "completed": done, "simulated_s": result.summary["duration"],
            "imbalance": result.summary["load_imbalance_mean"],
            "p50_ttft_ms": result.summary["median_ttft_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=2000.0, help="the not-overloaded rate, requests/s")
    parser.add_argument("--routers", default="round_robin,cache_aware")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    header = machine.header(1)
    print(header, flush=True)
    rows = ["| router | arrivals | wall s | CPU s | serve s | engine steps | completed | simulated s | "
            "load imbalance | p50 TTFT ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for router in args.routers.split(","):
        for label, rate in ((f"Poisson {args.rate:g}/s", args.rate), ("all at t=0 (overloaded)", float("inf"))):
            r = one_run(args.replicas, args.requests, rate, router)
            rows.append(f"| {router} | {label} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['serve_s']:.1f} | "
                        f"{r['steps']:,} | {r['completed']:,} | {r['simulated_s']:.1f} | {r['imbalance']:.3f} | "
                        f"{r['p50_ttft_ms']:.0f} |")
            print(rows[-1], flush=True)
    command = ("python experiments/bench_cluster_sim.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None))
    text = "\n".join([f"# Simulated cluster: {args.replicas} replicas, {args.requests:,} requests", "",
                      f"`{command}`", "", header, "", *rows, ""])
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
