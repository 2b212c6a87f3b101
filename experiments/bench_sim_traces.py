"""Simulator speed on public GPU-scale traces (issue 56): Llama-3-8B's architecture on simulated H100s
(analytical step times), the real scheduler, fcfs, a prefix cache, ``max_num_seqs=128``, the KV cache the
weights leave, step records aggregated per replica per minute (``records.steps=interval:60``).

    python experiments/bench_sim_traces.py --mooncake conversation_trace.jsonl --azure AzureLLMInferenceTrace_conv.csv

* Mooncake's conversation trace (kvcache-ai/Mooncake, ``FAST25-release/traces/conversation_trace.jsonl``:
  12,031 requests over 3,537 s) on 16 replicas, once behind ``round_robin`` and once behind ``cache_aware``.
  Prompts longer than Llama-3-8B's 8,192 tokens are refused with their reason (counted as refused).
* Azure's 2023 conversation trace (Azure/AzurePublicDataset, ``data/AzureLLMInferenceTrace_conv.csv``: 19,366
  requests in an hour) repeated back to back until ``--azure-requests`` (100,000), each pass's prompts the
  first pass's (the paged allocator: the trace says nothing of reuse), its arrival pattern time-scaled to a mean
  of ``--azure-rate`` requests a second, on 64 replicas behind ``round_robin``.
* Side by side, in this process: the first ``--compare-requests`` Mooncake requests on 16 replicas stepping
  every step (``fast_forward`` off) and with decode stretches (on); their records are compared (identical).

Prints, per run, wall and CPU seconds, engine steps, steps per wall second, the share of steps taken in decode
stretches, and the requests done and refused. Nothing is written to disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from pathlib import Path
from typing import Any

import yaml

from nanovllm import machine
from nanovllm.cluster.config import ClusterConfig
from nanovllm.config import EngineConfig
from nanovllm.harness.cluster import ServedCluster
from nanovllm.harness.workload import TraceWorkloadConfig, WorkloadRequest, generate_workload
from nanovllm.serving.monitor import Monitor, MonitorConfig
from nanovllm.serving.step_records import StepRecords

REPO = Path(__file__).resolve().parent.parent
H100 = yaml.safe_load((REPO / "conf/hardware/h100_sxm.yaml").read_text())
ENGINE = dict(dtype="bfloat16", max_num_seqs=128, num_kv_blocks=None, model="nanovllm/data/models/llama-3-8b")
RECORDS = StepRecords.parse("interval:60")


def build(replicas: int, router: str, allocator: str, fast_forward: bool) -> ServedCluster:
    runner = {"name": "sim", "step_time": "analytical", "fast_forward": fast_forward}
    return ServedCluster.simulated(ClusterConfig(replicas=replicas), router, runner, H100,
                                   EngineConfig(**ENGINE), allocator=allocator)


def serve(label: str, served: ServedCluster, workload: list[WorkloadRequest], records: StepRecords = RECORDS) -> Any:
    peaks = served.monitor_config(MonitorConfig(calibrate=False))   # the H100's, as python -m nanovllm.run uses
    monitor = Monitor(served.cost, peaks.peak_flops, peaks.peak_bandwidth)
    start, cpu = time.perf_counter(), time.process_time()
    result = served.serve(workload, step_records=records, monitor=monitor)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    s = result.summary
    ahead = sum(replica.engine.num_steps_ahead for replica in served.cluster.replicas)
    steps = s["num_steps"]
    print(f"{label}: {len(workload):,} requests ({s['completed']:,} done, {s['failed']:,} refused) in "
          f"{wall:.1f} s wall ({cpu:.1f} s CPU); {steps:,} engine steps = {steps / wall:,.0f} steps/s, "
          f"{ahead / steps:.1%} in decode stretches; {result.wall_time:,.0f} simulated s", flush=True)
    return result, wall


def tiled(requests: list[WorkloadRequest], total: int, rate: float) -> list[WorkloadRequest]:
    """``requests`` repeated back to back (each pass starts one mean gap after the last one's last arrival) up
    to ``total``, then time-scaled to a mean of ``rate`` arrivals a second."""
    span = requests[-1].arrival_time - requests[0].arrival_time
    period = span * len(requests) / max(1, len(requests) - 1)
    out = []
    for index in range(total):
        passes, row = divmod(index, len(requests))
        out.append(dataclasses.replace(requests[row], arrival_time=requests[row].arrival_time + passes * period,
                                       request_id=str(index)))
    scale = total / rate / (out[-1].arrival_time or 1.0)
    return [dataclasses.replace(r, arrival_time=r.arrival_time * scale) for r in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mooncake", help="conversation_trace.jsonl (Mooncake)")
    parser.add_argument("--azure", help="AzureLLMInferenceTrace_conv.csv")
    parser.add_argument("--azure-requests", type=int, default=100_000)
    parser.add_argument("--azure-rate", type=float, default=200.0, help="mean arrivals a second after scaling")
    parser.add_argument("--azure-replicas", type=int, default=64)
    parser.add_argument("--compare-requests", type=int, default=400,
                        help="Mooncake requests served both stepping and fast-forwarded (0: skip)")
    parser.add_argument("--routers", default="round_robin,cache_aware")
    args = parser.parse_args()

    import torch

    print(machine.header(torch.get_num_threads()), flush=True)
    if args.mooncake:
        tokenizer = build(1, "round_robin", "prefix", True).engine.tokenizer
        trace = generate_workload(TraceWorkloadConfig(path=args.mooncake), tokenizer)
        if args.compare_requests:
            head = trace[:args.compare_requests]
            stepped, slow = serve(f"mooncake first {len(head)}, 16 replicas, round_robin, stepping",
                                  build(16, "round_robin", "prefix", False), head, StepRecords())
            fast_result, fast = serve(f"mooncake first {len(head)}, 16 replicas, round_robin, fast_forward",
                                      build(16, "round_robin", "prefix", True), head, StepRecords())
            same = fast_result.requests == stepped.requests and fast_result.steps == stepped.steps
            print(f"  fast_forward / stepping wall time: {fast / slow:.3f} ({slow / fast:.1f}x faster); "
                  f"records identical: {same}", flush=True)
            # Their every-step records would stay alive through the timed runs below, each collection walking them.
            del stepped, fast_result
            gc.collect()
        for router in args.routers.split(","):
            serve(f"mooncake {len(trace):,}, 16 replicas, {router}", build(16, router, "prefix", True), trace)
    if args.azure:
        served = build(args.azure_replicas, "round_robin", "paged", True)
        trace = generate_workload(TraceWorkloadConfig(path=args.azure), served.engine.tokenizer)
        workload = tiled(trace, args.azure_requests, args.azure_rate)
        serve(f"azure conv x{len(workload) / len(trace):.2f} = {len(workload):,} at {args.azure_rate:g} req/s, "
              f"{args.azure_replicas} replicas, round_robin", served, workload)


if __name__ == "__main__":
    main()
