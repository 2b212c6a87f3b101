"""The KV tiers study of issue 57 (docs/kv_tiers.md), on the simulator: Llama-3-8B (analytical step times) on
H100 replicas (conf/hardware/h100_sxm.yaml, its kv_tier_links) behind cache_aware, serving multi-turn sessions
whose working set is about four times each replica's primary pool.

1. Tiers: no tiers vs host vs host+disk vs shared, at two request rates, with 16 and 64 replicas: hit rate per
   tier (tier hit tokens over prompt tokens; ``pool`` is the primary pool's), p50/p99 TTFT, throughput.
2. Preemption under memory pressure, one replica: recompute without tiers, recompute with a host tier (evicted
   blocks come back from it), swap to the host tier.

The pool is scaled down (``--pool-blocks`` blocks of 16 tokens a replica, not the ~28k an H100 holds for this
model) so that a run of a few minutes on one core simulates enough sessions to fill four pools per replica;
the ratio, not the size, is what the study holds. Prints one table per part.

    python experiments/kv_tiers_study.py                    # both parts, 16 replicas (~3 minutes on one core)
    python experiments/kv_tiers_study.py --replicas 16 64   # and 64 replicas (about four times as long again)
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from pathlib import Path
from typing import Any

import yaml

from nanovllm.cluster.config import ClusterConfig
from nanovllm.config import EngineConfig
from nanovllm.harness.cluster import ServedCluster
from nanovllm.harness.workload.config import LengthDist, MultiTurnWorkloadConfig, SyntheticWorkloadConfig
from nanovllm.harness.workload.generate import generate_workload

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "nanovllm/data/models/llama-3-8b")
HARDWARE = yaml.safe_load((ROOT / "conf/hardware/h100_sxm.yaml").read_text())
RUNNER = {"name": "sim", "step_time": "analytical"}
BLOCK = 16
BLOCK_BYTES = 32 * 2 * BLOCK * 8 * 128 * 2   # Llama-3-8B in bfloat16: 2 MiB a block

# About 1,000 tokens a session (256 system + 6 x 96 user + 5 x 32 replies): a pool holds about four.
SESSION = dict(turns=LengthDist(kind="fixed", mean=6, max=64), user_len=LengthDist(kind="uniform", mean=96),
               reply_len=LengthDist(kind="uniform", mean=32), num_system_prompts=4, system_len=256,
               think_time_s=1.0)


def tiers(pool_blocks: int) -> dict[str, Any]:
    """The offload settings compared, sized from the pool: host holds about two pools (half the working set),
    disk and the shared store all of it and more."""
    host = {"name": "host", "capacity": 2 * pool_blocks * BLOCK_BYTES, "policy": "evict"}
    return {"none": None, "host": host,
            "host+disk": {**host, "below": {"name": "disk", "capacity": 64 * pool_blocks * BLOCK_BYTES}},
            "shared": {"name": "shared", "capacity": 64 * pool_blocks * BLOCK_BYTES, "policy": "write_through"}}


def serve(replicas: int, kv_offload: Any, workload_cfg: Any, pool_blocks: int, **engine: Any) -> dict[str, Any]:
    config = EngineConfig(model=MODEL, dtype="bfloat16", num_kv_blocks=pool_blocks, block_size=BLOCK,
                          max_num_seqs=64, max_model_len=8192, kv_offload=kv_offload, **engine)
    cluster = ServedCluster.simulated(ClusterConfig(replicas=replicas), "cache_aware", RUNNER, HARDWARE, config,
                                      allocator="prefix")
    result = cluster.serve(generate_workload(workload_cfg, cluster.engine.replicas[0].engine.tokenizer))
    for replica in cluster.engine.replicas:
        replica.engine.close()
    return result.summary


def tier_rows(replica_counts: list[int], rates: list[float], pool_blocks: int) -> None:
    print(f"\n## Tiers: working set ~4 pools a replica ({pool_blocks} blocks = {pool_blocks * BLOCK} tokens), "
          "cache_aware, Llama-3-8B on H100 (analytical)")
    print("| replicas | rate/replica | tiers | requests | hit pool | hit host | hit disk | hit shared | "
          "p50 TTFT ms | p99 TTFT ms | req/s | out tok/s | sim s | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for replicas in replica_counts:
        working_set = 4 * pool_blocks * BLOCK * replicas
        for rate in rates:
            workload = MultiTurnWorkloadConfig(**SESSION, request_rate=rate * replicas, working_set_tokens=working_set,
                                               seed=0)
            for name, spec in tiers(pool_blocks).items():
                start = time.perf_counter()
                s = serve(replicas, spec, workload, pool_blocks)
                prompt = s["total_input_tokens"]
                hits = {tier: v["hit_tokens"] / prompt for tier, v in (s.get("kv_tiers") or {}).items()}
                pool = s["prefix_cache_hit_rate"] - sum(hits.values())
                cell = lambda tier: f"{hits[tier]:.1%}" if tier in hits else "-"   # noqa: E731
                print(f"| {replicas} | {rate:g} | {name} | {s['completed']} | {pool:.1%} | {cell('host')} | "
                      f"{cell('disk')} | {cell('shared')} | {s['median_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} | "
                      f"{s['request_throughput']:.1f} | {s['output_throughput']:.0f} | {s['duration']:.0f} | "
                      f"{time.perf_counter() - start:.0f} |", flush=True)


def preemption_rows(pool_blocks: int) -> None:
    print(f"\n## Preemption under memory pressure: one replica, {pool_blocks} blocks, 32 requests of "
          "512 prompt + 512 output tokens at once (each ends at 64 blocks), host tier 8 pools")
    print("| mode | tiers | preemptions | recomputed tokens | swapped tokens | p50 TTFT ms | p99 TTFT ms | "
          "out tok/s | sim s |")
    print("|---|---|---|---|---|---|---|---|---|")
    blocks = pool_blocks
    host = {"name": "host", "capacity": 8 * blocks * BLOCK_BYTES}
    workload = SyntheticWorkloadConfig(num_requests=32, request_rate=math.inf, seed=0, ignore_eos=True,
                                       input_len=LengthDist(kind="fixed", mean=512, max=8192),
                                       output_len=LengthDist(kind="fixed", mean=512, max=8192))
    for mode, spec in (("recompute", None), ("recompute", host), ("swap", host)):
        s = serve(1, spec, workload, blocks, preemption_mode=mode)
        print(f"| {mode} | {'host' if spec else 'none'} | {s['num_preemptions']} | {s['recomputed_tokens']} | "
              f"{s.get('swapped_tokens', 0)} | {s['median_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} | "
              f"{s['output_throughput']:.0f} | {s['duration']:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[16])
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0], help="requests/s per replica")
    parser.add_argument("--pool-blocks", type=int, default=256)
    parser.add_argument("--skip-preemption", action="store_true")
    args = parser.parse_args()
    logging.getLogger("nanovllm").setLevel(logging.ERROR)   # tier misses log a line each: the table counts them
    start = time.perf_counter()
    tier_rows(args.replicas, args.rates, args.pool_blocks)
    if not args.skip_preemption:
        preemption_rows(args.pool_blocks)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
