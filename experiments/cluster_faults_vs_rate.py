"""What replica failures cost a simulated 64-replica cluster: goodput and p99 TTFT against the replica failure rate.

    python experiments/cluster_faults_vs_rate.py [--replicas 64] [--failure-rates 0,60,240,960] \
        [--rate-per-replica 8] [--seconds 10] [--restart-delay 30] [--seeds 0]

Every replica is Meta-Llama-3-8B's architecture (``nanovllm/data/models/llama-3-8b``, no weights) in bfloat16 on
the H100 SXM profile (``conf/hardware/h100_sxm.yaml``, the analytical step-time model: an estimate), 128
sequences, behind ``least_loaded``. Poisson arrivals at ``rate_per_replica`` x replicas requests/s for ``seconds``
of simulated time; prompts 1024 +- 50% tokens, outputs 128 +- 50%. Each replica dies as a Poisson process at the
failure rate (deaths per replica per hour, ``cluster.faults.rate``, seeded), comes back ``restart_delay`` seconds
later with an empty cache (``cluster.max_restarts`` unbounded), and every request it held resumes on a live
replica from its prompt and generated tokens (``cluster.max_retries=3``). Goodput: requests/s that completed
within both SLOs (TTFT <= 1 s, TPOT <= 40 ms: the disaggregation study's), over the time until the last request
ended. Prints one line per point and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from nanovllm.cluster.config import ClusterConfig  # noqa: E402
from nanovllm.config import EngineConfig  # noqa: E402
from nanovllm.harness.cluster import ServedCluster  # noqa: E402
from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, generate_workload  # noqa: E402
from nanovllm.serving.metrics import is_completed, tpot_s, ttft_s  # noqa: E402

GPU_MODEL = ROOT / "nanovllm" / "data" / "models" / "llama-3-8b"
HARDWARE = ROOT / "conf" / "hardware" / "h100_sxm.yaml"
TTFT_SLO_MS, TPOT_SLO_MS = 1000.0, 40.0


def point(replicas: int, failure_rate: float, args: argparse.Namespace, seed: int) -> dict:
    """One simulated run at ``failure_rate`` deaths per replica per hour; its figures."""
    hardware = yaml.safe_load(HARDWARE.read_text(encoding="utf-8"))
    config = EngineConfig(model=str(GPU_MODEL), dtype="bfloat16", max_num_seqs=128)
    cluster = ClusterConfig(replicas=replicas, max_retries=3, max_restarts=1_000_000,
                            faults={"rate": failure_rate, "seed": seed, "restart_delay": args.restart_delay})
    started = time.perf_counter()
    served = ServedCluster.simulated(cluster, "least_loaded", {"name": "sim", "step_time": "analytical"},
                                     hardware, config)
    rate = args.rate_per_replica * replicas
    workload = generate_workload(SyntheticWorkloadConfig(
        num_requests=int(rate * args.seconds), request_rate=rate, seed=seed,
        input_len=LengthDist(kind="uniform", mean=1024, range_ratio=0.5),
        output_len=LengthDist(kind="uniform", mean=128, range_ratio=0.5)), served.engine.tokenizer)
    result = served.serve(workload)
    records = result.requests
    duration = max(r["finish_time"] or 0.0 for r in records)
    good = sum(1 for r in records if is_completed(r) and ttft_s(r) * 1e3 <= TTFT_SLO_MS
               and (tpot_s(r) is None or tpot_s(r) * 1e3 <= TPOT_SLO_MS))
    ttfts = np.array([ttft_s(r) for r in records if is_completed(r)]) * 1e3
    faults = result.summary.get("faults") or {"replica_deaths": 0, "retried_requests": 0,   # none injected
                                              "retry_recomputed_tokens": 0}
    deaths = faults["replica_deaths"]
    return {"failures_per_replica_hour": failure_rate, "seed": seed, "requests": len(records),
            "deaths": deaths, "retried": faults["retried_requests"], "recomputed_tokens": faults["retry_recomputed_tokens"],
            "failed": sum(r["error"] is not None for r in records), "goodput_req_s": good / duration,
            "p50_ttft_ms": float(np.percentile(ttfts, 50)), "p99_ttft_ms": float(np.percentile(ttfts, 99)),
            "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--failure-rates", default="0,60,240,960")
    parser.add_argument("--rate-per-replica", type=float, default=8.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--restart-delay", type=float, default=30.0)
    parser.add_argument("--seeds", default="0")
    args = parser.parse_args()
    rows = []
    for failure_rate in map(float, args.failure_rates.split(",")):
        for seed in map(int, args.seeds.split(",")):
            row = point(args.replicas, failure_rate, args, seed)
            rows.append(row)
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    print("\n| failures / replica / hour | seed | deaths | requests resumed | tokens recomputed | failed | "
          "goodput req/s | p50 TTFT ms | p99 TTFT ms | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['failures_per_replica_hour']:g} | {r['seed']} | {r['deaths']} | {r['retried']} | "
              f"{r['recomputed_tokens']:,} | {r['failed']} | {r['goodput_req_s']:.1f} | {r['p50_ttft_ms']:,.0f} | "
              f"{r['p99_ttft_ms']:,.0f} | {r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
