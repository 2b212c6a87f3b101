"""The KV tiers study at 2 real replicas on this machine, and the simulator's prediction of it, side by side:
issue 57's check that p50 TTFT and the hit rate of every tier come within 15% (docs/kv_tiers.md).

    python experiments/kv_tiers_real_vs_sim.py [--rate 2] [--pool-blocks 128] [--rounds 2] [--out ...]

The workload is ``bench_kv_tiers.py``'s multi-turn sessions (~1,000 tokens: a 384-token system prompt, one of
2, five ~96-token turns with 16-token replies), as many as hold four primary pools a replica, at ``--rate``
requests/s for the cluster, behind ``cache_aware``, with each tier setting of the simulated study:

* ``none``; ``host`` (two pools a replica: half the working set); ``host+disk`` (that host tier over a disk
  tier of 64 pools, files under a temporary directory); ``shared`` (write-through into one store of 64 pools a
  replica, the real one in ``/dev/shm``, a fresh store each run).

Each setting is served by:

* real: 2 engine replicas in Ray actors (``ServedCluster.real``, one torch thread each, on this machine's two
  cores), the router in the driver, on the wall clock, ``--rounds`` times (settings taking turns);
* sim: 2 simulated replicas (``ServedCluster.simulated``) running the same tier and offload-policy classes
  without payload, on a profile calibrated from real 2-replica runs of this workload with another seed
  (``CALIBRATION_SEED``): ``none`` at 0.5x and 1.5x ``--rate`` for the step terms, ``host+disk`` and
  ``shared`` at ``--rate`` for the tiers' links too (``nanovllm.harness.sim.calibrate``: the step terms are
  fitted to each step's time less its tier moves, and every tier's link, latency and bandwidth, to those
  moves). Nothing is fitted on the runs it is compared with.

Per setting: p50 TTFT, the hit rate of the pool and of each tier (tokens loaded from it over prompt tokens),
output throughput, real (mean over rounds, and each round) and simulated, their ratio and whether it is within
15%. Writes ``experiments/results/kv_tiers_real_vs_sim.md``, the profile and the measurements (``.json``)
beside it; ``--from-json`` renders the page again from them.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kv_tiers import workload_config  # noqa: E402
from cluster_real_vs_sim import write_page  # noqa: E402

from nanovllm import machine  # noqa: E402
from nanovllm.cluster.config import ClusterConfig  # noqa: E402
from nanovllm.config import EngineConfig  # noqa: E402
from nanovllm.harness.cluster import ServedCluster  # noqa: E402
from nanovllm.harness.sim.calibrate import calibrate  # noqa: E402
from nanovllm.harness.workload.generate import generate_workload  # noqa: E402
from nanovllm.serving.loggers import JsonlLogger  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "experiments" / "results" / "kv_tiers_real_vs_sim.md"
REPLICAS = 2
BLOCK = 16
ROUTER = "cache_aware"
CALIBRATION_SEED = 1        # the compared runs are seed 0's
CALIBRATION_RATES = (0.5, 1.5)   # x --rate, without tiers: the step terms from a light and a heavy load
CALIBRATION_TIERS = ("host+disk", "shared")   # at --rate: every tier's link
TIERS = ("none", "host", "host+disk", "shared")
LEVELS = ("pool", "host", "disk", "shared")
WITHIN = 0.15


def engine_config(pool_blocks: int, tiers: str, block_bytes: int, scratch: Path) -> EngineConfig:
    """The replicas' settings for one tier setting (``block_bytes``: one block's K/V, sizing the tiers)."""
    host = {"name": "host", "capacity": 2 * pool_blocks * block_bytes, "policy": "evict"}
    offload: dict[str, Any] | None = {
        "none": None, "host": host,
        "host+disk": {**host, "below": {"name": "disk", "capacity": 64 * pool_blocks * block_bytes,
                                        "path": str(scratch / f"disk-{uuid.uuid4().hex[:8]}")}},
        "shared": {"name": "shared", "capacity": 64 * pool_blocks * block_bytes, "policy": "write_through",
                   "store": f"study-{uuid.uuid4().hex[:12]}"},
    }[tiers]
    return EngineConfig(dtype="bfloat16", num_kv_blocks=pool_blocks, block_size=BLOCK, max_num_seqs=8,
                        max_model_len=4096, kv_offload=offload)


def figures(result: Any) -> dict[str, float]:
    """p50 TTFT, throughput and the hit rate of each level (tokens served from it over prompt tokens)."""
    summary, requests = result.summary, result.requests
    prompt = sum(r["num_prompt_tokens"] for r in requests)
    by_level = {level: 0 for level in LEVELS}
    for record in requests:
        split = record.get("cached_tokens_by_tier") or {"primary": record["num_cached_tokens"]}
        for level, tokens in split.items():
            by_level["pool" if level == "primary" else level] += tokens
    return {"p50_ttft_ms": summary["median_ttft_ms"], "tok_s": summary["output_throughput"],
            **{f"hit_{level}": tokens / prompt for level, tokens in by_level.items()},
            "requests": len(requests), "failed": summary["failed"]}


def serve(kind: str, tiers: str, args: argparse.Namespace, seed: int, rate: float, block_bytes: int,
          scratch: Path, profile: Path | None = None, run_dir: Path | None = None) -> dict[str, float]:
    """One run of ``tiers`` (real or simulated); ``run_dir``: write its records there (for calibration)."""
    config = engine_config(args.pool_blocks, tiers, block_bytes, scratch)
    cluster = ClusterConfig(replicas=REPLICAS)
    if kind == "real":
        served = ServedCluster.real(cluster, ROUTER, config, allocator="prefix")
    else:
        runner = {"name": "sim", "step_time": "calibrated", "profile": str(profile)}
        served = ServedCluster.simulated(cluster, ROUTER, runner, None, config, allocator="prefix")
    loggers = []
    if run_dir is not None:
        logger = JsonlLogger()
        logger.start(run_dir, {"engine": {"dtype": config.dtype, "kv_offload": config.kv_offload},
                               "model": {"path": None}, "attention": {"name": "cpu"},
                               "cluster": {"replicas": REPLICAS}, "router": {"name": ROUTER}}, name=run_dir.name)
        loggers.append(logger)
    try:
        working_set = 4 * args.pool_blocks * BLOCK * REPLICAS
        workload = generate_workload(workload_config(working_set, rate, seed), served.engine.tokenizer)
        return figures(served.serve(workload, loggers=loggers, progress=False))
    finally:
        for logger in loggers:
            logger.finish()
        served.close()


def kv_block_bytes(pool_blocks: int) -> int:
    """One block's K/V bytes for the default model in bfloat16 (from its HF config, no weights loaded)."""
    from nanovllm.harness.sim.simulate import Simulation

    sim = Simulation.build(EngineConfig(dtype="bfloat16", num_kv_blocks=pool_blocks, block_size=BLOCK),
                           {"name": "token_cost"})
    return int(sim.engine.kv_block_bytes)


def measure(args: argparse.Namespace, out: Path) -> dict:
    import torch

    torch.set_num_threads(1)
    header = machine.header(1)
    print(header, flush=True)
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="kv_tiers_real_vs_sim_"))
    block_bytes = kv_block_bytes(args.pool_blocks)
    try:
        if args.profile:
            profile_path = Path(args.profile)
        else:
            profile_path = out.with_name(out.stem + "_profile.yaml")
            runs = []
            plan = [("none", args.rate * f) for f in CALIBRATION_RATES] + [(t, args.rate) for t in CALIBRATION_TIERS]
            for tiers, rate in plan:
                run_dir = scratch / f"calibration_{tiers}_rate{rate:g}_seed{CALIBRATION_SEED}"
                print(f"calibration run: {run_dir.name}", flush=True)
                serve("real", tiers, args, CALIBRATION_SEED, rate, block_bytes, scratch, run_dir=run_dir)
                runs.append(run_dir)
            profile = calibrate(runs, profile_path,
                                command="python experiments/kv_tiers_real_vs_sim.py (its calibration step)")
            print(f"profile: {profile_path} (R^2 {profile['fit']['r2']:.3f}, links "
                  f"{profile.get('kv_tier_links')})", flush=True)
        real: dict[str, list[dict[str, float]]] = {tiers: [] for tiers in TIERS}
        sim: dict[str, dict[str, float]] = {}
        for round_index in range(args.rounds):
            for tiers in TIERS:
                real[tiers].append(serve("real", tiers, args, 0, args.rate, block_bytes, scratch))
                print(f"round {round_index} {tiers} real {real[tiers][-1]}", flush=True)
                if tiers not in sim:   # deterministic: one run each
                    sim[tiers] = serve("sim", tiers, args, 0, args.rate, block_bytes, scratch, profile_path)
                    print(f"{tiers} sim {sim[tiers]}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    command = "python experiments/kv_tiers_real_vs_sim.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k not in ("out", "profile", "from_json") and v is not None)
    return {"command": command, "header": header, "rate": args.rate, "pool_blocks": args.pool_blocks,
            "block_bytes": block_bytes, "profile": profile_path.name, "wall_s": time.perf_counter() - started,
            "real_runs": real, "sim": sim}


def report(data: dict) -> str:
    """The results page from what ``measure`` recorded."""
    real_runs, sim = data["real_runs"], data["sim"]
    lines = [f"# KV tiers at {REPLICAS} real replicas and in the simulator ({data['wall_s']:.0f} s of wall time)",
             "", f"`{data['command']}`", "", f"{data['header']} | one torch thread per replica", "",
             f"Primary pool {data['pool_blocks']} blocks of {BLOCK} tokens a replica, working set ~4 pools a "
             f"replica, {data['rate']:g} req/s, `{ROUTER}`. Simulated on `{data['profile']}`, fitted on real "
             f"2-replica runs of this workload with seed {CALIBRATION_SEED} (the compared runs: seed 0).", "",
             "| tiers | metric | real rounds | real mean | sim | sim/real | within 15% |", "|---|---|---|---|---|---|---|"]
    within = total = 0
    for tiers, runs in real_runs.items():
        metrics = ["p50_ttft_ms", "tok_s"] + [f"hit_{level}" for level in LEVELS
                                              if any(run[f"hit_{level}"] for run in runs) or sim[tiers][f"hit_{level}"]]
        for metric in metrics:
            values = [run[metric] for run in runs]
            mean, predicted = statistics.fmean(values), sim[tiers][metric]
            ratio = predicted / mean if mean else float("inf")
            ok = abs(ratio - 1) <= WITHIN
            within, total = within + ok, total + 1
            fmt = "{:,.0f}" if metric == "p50_ttft_ms" else "{:.1f}" if metric == "tok_s" else "{:.1%}"
            lines.append(f"| {tiers} | {metric} | {' / '.join(fmt.format(v) for v in values)} | {fmt.format(mean)} "
                         f"| {fmt.format(predicted)} | {ratio:.3f} | {'yes' if ok else 'no'} |")
    lines += ["", f"{within} of {total} figures within 15% of the real mean."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s for the whole cluster")
    parser.add_argument("--pool-blocks", type=int, default=128, help="primary pool blocks a replica")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", default=None, help="a profile fitted before (skips the calibration runs)")
    parser.add_argument("--from-json", default=None, help="render the page again from a recorded .json")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    logging.getLogger("nanovllm").setLevel(logging.ERROR)   # tier misses log a line each: the table counts them
    write_page(args, Path(args.out), measure, report)


if __name__ == "__main__":
    main()
