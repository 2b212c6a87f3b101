"""Routers x request rate on a multi-turn, shared-prefix workload, on simulated clusters of 16 and 64 replicas.

    python experiments/cluster_routers_vs_rate.py [--replicas 16,64] [--per-replica-rates 1,2,4,6]
                                                 [--sessions-per-replica 60] [--routers all] [--out ...]

The workload (``workload=multi_turn``): sessions of 2-6 turns, each turn re-sending the conversation so far after
one of 8 shared system prompts of 256 tokens; user messages 48 +- 50% tokens, replies 24 +- 50%. Sessions per
replica are fixed, so the 64-replica cluster serves 4x the 16-replica one's requests. The rate is requests/s per
replica (x the replica count for the cluster). Every replica: the default model in bfloat16 on the shipped
calibrated profile (named: ``PROFILE``), ``allocator=prefix``, 256 KV blocks (4,096 tokens), 16 sequences, fcfs. Per point: cluster
p50 and p99 TTFT, output throughput, prefix-cache hit rate (cached over prompt tokens) and the mean load
imbalance (max/mean outstanding requests at arrivals). Writes ``experiments/results/cluster_routers_vs_rate.md``
and a plot of p99 TTFT and hit rate against rate (``.png`` beside it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nanovllm import ROUTERS, machine
from nanovllm.cluster.config import ClusterConfig
from nanovllm.config import EngineConfig
from nanovllm.harness.cluster import ServedCluster
from nanovllm.harness.sim.step_time import shipped_profile
from nanovllm.harness.workload import LengthDist, MultiTurnWorkloadConfig, generate_workload

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "experiments" / "results" / "cluster_routers_vs_rate.md"
ENGINE = dict(num_kv_blocks=256, max_num_seqs=16, dtype="bfloat16")


def workload_config(sessions: int, rate: float, seed: int = 0) -> MultiTurnWorkloadConfig:
    return MultiTurnWorkloadConfig(
        num_sessions=sessions, request_rate=rate, seed=seed, num_system_prompts=8, system_len=256,
        turns=LengthDist(kind="uniform", mean=4, range_ratio=0.5, max=16),
        user_len=LengthDist(kind="uniform", mean=48, range_ratio=0.5),
        reply_len=LengthDist(kind="uniform", mean=24, range_ratio=0.5),
        think_time_s=2.0, reply_time_per_token_s=0.05)


# The shipped bfloat16 profile, named: a machine with a profile of its own in the cache would otherwise use that one,
# and the table would describe another machine's replicas than the docs say.
PROFILE = shipped_profile("bfloat16")


def one_point(replicas: int, router: str, rate: float, sessions: int) -> dict[str, float]:
    served = ServedCluster.simulated(ClusterConfig(replicas=replicas), router,
                                     {"name": "sim", "step_time": "calibrated", "profile": str(PROFILE)}, None,
                                     EngineConfig(**ENGINE), allocator="prefix")
    result = served.serve(generate_workload(workload_config(sessions, rate), served.engine.tokenizer))
    s = result.summary
    prompt = sum(r["num_prompt_tokens"] for r in result.requests)
    return {"p50_ttft_ms": s["median_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"], "tok_s": s["output_throughput"],
            "hit_rate": sum(r["num_cached_tokens"] for r in result.requests) / prompt,
            "imbalance": s["load_imbalance_mean"], "requests": len(result.requests),
            "failed": s["failed"]}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({row["replicas"] for row in rows})
    fig, axes = plt.subplots(2, len(sizes), figsize=(6 * len(sizes), 8), squeeze=False)
    for column, size in enumerate(sizes):
        for router in dict.fromkeys(row["router"] for row in rows):
            mine = [row for row in rows if row["replicas"] == size and row["router"] == router]
            rates = [row["rate"] for row in mine]
            axes[0][column].plot(rates, [row["p99_ttft_ms"] for row in mine], marker="o", label=router)
            axes[1][column].plot(rates, [row["hit_rate"] for row in mine], marker="o", label=router)
        axes[0][column].set(title=f"{size} replicas", ylabel="p99 TTFT (ms)", yscale="log")
        axes[1][column].set(xlabel="requests/s per replica", ylabel="prefix-cache hit rate")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="16,64")
    parser.add_argument("--per-replica-rates", default="1,2,4,6")
    parser.add_argument("--sessions-per-replica", type=int, default=60)
    parser.add_argument("--routers", default="all")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    routers = ROUTERS.names() if args.routers == "all" else args.routers.split(",")
    header = machine.header(1)
    print(header, flush=True)
    rows: list[dict] = []
    started = time.perf_counter()
    for replicas in map(int, args.replicas.split(",")):
        for rate in map(float, args.per_replica_rates.split(",")):
            for router in routers:
                point = one_point(replicas, router, rate * replicas, args.sessions_per_replica * replicas)
                rows.append({"replicas": replicas, "router": router, "rate": rate, **point})
                print(rows[-1], flush=True)
    lines = [f"# Routers x rate, simulated ({time.perf_counter() - started:.0f} s of wall time)", "",
             "`python experiments/cluster_routers_vs_rate.py " + " ".join(
                 f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out") + "`", "", header, "",
             "| replicas | req/s per replica | router | requests | p50 TTFT ms | p99 TTFT ms | output tok/s | "
             "hit rate | load imbalance | failed |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['replicas']} | {r['rate']:g} | {r['router']} | {r['requests']:,} | {r['p50_ttft_ms']:,.0f} | "
              f"{r['p99_ttft_ms']:,.0f} | {r['tok_s']:,.0f} | {r['hit_rate']:.3f} | {r['imbalance']:.2f} | "
              f"{r['failed']} |" for r in rows]
    out = Path(args.out)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
