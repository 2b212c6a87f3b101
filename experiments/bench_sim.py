"""Simulator speed: how many requests per wall-clock second, and the real-time factor (simulated seconds per
wall second), with the default policy (fcfs) and the shipped calibrated profile (or, with ``--hardware``, the
analytical model of the default model in bfloat16 on that hardware).

    python experiments/bench_sim.py [--requests 100000] [--rate 0.3] [--max-num-seqs 32] [--profile-top 0]
    python experiments/bench_sim.py --hardware conf/hardware/h100_sxm.yaml --rate 100 --max-num-seqs 256

A synthetic workload (Poisson arrivals, prompts 128 +- 50%, outputs 16 +- 50% tokens) served by the real
scheduler/policy/allocator on the virtual clock; nothing is written to disk. ``--profile-top N`` prints the N
most expensive functions (cProfile) to find the hot path.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import yaml

from nanovllm import machine
from nanovllm.config import EngineConfig
from nanovllm.harness.sim import Hardware, Simulation
from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, generate_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=0.3)
    parser.add_argument("--hardware", help="a conf/hardware/*.yaml file: simulate it with the analytical model")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--scheduler", default="fcfs")
    parser.add_argument("--profile-top", type=int, default=0)
    args = parser.parse_args()

    import torch  # the simulator's own steps run in this process

    print(machine.header(torch.get_num_threads()), flush=True)
    if args.hardware:
        hardware = Hardware.from_config(yaml.safe_load(open(args.hardware, encoding="utf-8")))
        sim = Simulation.build(EngineConfig(max_num_seqs=args.max_num_seqs, dtype="bfloat16"), "analytical",
                               hardware=hardware, scheduler=args.scheduler)
    else:
        sim = Simulation.build(EngineConfig(max_num_seqs=args.max_num_seqs, num_kv_blocks=4096), "calibrated",
                               scheduler=args.scheduler)
    workload = generate_workload(SyntheticWorkloadConfig(
        num_requests=args.requests, request_rate=args.rate,
        input_len=LengthDist(kind="uniform", mean=128, range_ratio=0.5),
        output_len=LengthDist(kind="uniform", mean=16, range_ratio=0.5)), sim.engine.tokenizer)
    profiler = cProfile.Profile() if args.profile_top else None
    start, cpu_start = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    result = sim.serve(workload)
    if profiler:
        profiler.disable()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    s = result.summary
    print(f"{s['completed']:,} requests ({s['total_output_tokens']:,} output tokens, {len(result.steps):,} steps) "
          f"simulated in {wall:.1f} s wall = {s['completed'] / wall:,.0f} requests/s; simulated duration "
          f"{result.wall_time:,.0f} s -> real-time factor {result.wall_time / wall:,.0f}x "
          f"(p50 TTFT {s['median_ttft_ms']:.0f} ms, output {s['output_throughput']:.1f} tok/s simulated); "
          f"CPU time of this process {cpu:.1f} s (the machine is shared: wall > CPU means other load)")
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile_top)


if __name__ == "__main__":
    main()
