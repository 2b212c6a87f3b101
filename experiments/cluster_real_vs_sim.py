"""The routers study at 2 real replicas on this machine, and the simulator's prediction for it, side by side.

    python experiments/cluster_real_vs_sim.py [--routers round_robin,least_loaded,consistent_hash,cache_aware]
                                              [--rate 8] [--sessions 64] [--rounds 4] [--out ...]

The workload is ``cluster_routers_vs_rate.py``'s multi-turn, shared-prefix one (8 system prompts of 256 tokens,
2-6 turns a session), at ``--rate`` requests/s for the whole cluster. Each router is served by:

* real: 2 engine replicas in Ray actors (``ServedCluster.real``, one torch thread each, on this machine's two
  cores), the router in the driver, on the wall clock;
* sim: 2 simulated replicas (``ServedCluster.simulated``) on a step-time profile of this machine *as the real
  cluster uses it*;

with the same requests (same seed), the same engine settings (``ENGINE`` of the 16/64-replica study) and the same
router class. Real runs alternate router by router and ``--rounds`` repeats them (the real figure is the mean).

The profile. A replica that shares the machine with another one steps slower than one alone (the two compete
for memory bandwidth and caches, and the driver and Ray's daemons take CPU from them), by how much depending on
what the other one runs: measured here, two replicas' steps took longer than the one-engine profile predicts,
and a profile fitted on two replicas serving ``calibrate --this-machine``'s synthetic and chat workloads
mispredicted this workload's steps too (docs/cluster.md has the figures). So the simulator is calibrated, as for one engine, on real
runs of what it simulates: the real 2-replica cluster serving this workload with round_robin at 0.5x and 1.5x
``--rate`` with seed 1 (``CALIBRATION_RATES``, ``CALIBRATION_SEED``), fitted by
``nanovllm.harness.sim.calibrate``. The study's runs (seed 0, ``--rate``, every router) are not among them:
nothing is fitted on the runs it is compared with.

Per router: cluster output throughput and p50 TTFT, real and simulated and their ratio, the prefix-cache hit
rates, and the routers ranked by p50 TTFT in each; and, since two routers a few percent apart swap places from
one real round to the next, which orderings the real runs resolve (means more than 2 standard errors apart) and
whether the simulator orders those the same. Writes ``experiments/results/cluster_real_vs_sim.md`` and the
fitted profile and the measurements (``.json``) beside it; ``--from-json`` renders the page again from them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_routers_vs_rate import ENGINE, workload_config  # noqa: E402

from nanovllm import machine  # noqa: E402
from nanovllm.cluster.config import ClusterConfig  # noqa: E402
from nanovllm.config import EngineConfig  # noqa: E402
from nanovllm.harness.cluster import ServedCluster  # noqa: E402
from nanovllm.harness.sim.calibrate import calibrate  # noqa: E402
from nanovllm.harness.workload import generate_workload  # noqa: E402
from nanovllm.serving.loggers import JsonlLogger  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "experiments" / "results" / "cluster_real_vs_sim.md"
REPLICAS = 2


def figures(result) -> dict[str, float]:
    s = result.summary
    prompt = sum(r["num_prompt_tokens"] for r in result.requests)
    return {"tok_s": s["output_throughput"], "p50_ttft_ms": s["median_ttft_ms"],
            "hit_rate": sum(r["num_cached_tokens"] for r in result.requests) / prompt,
            "requests": len(result.requests), "failed": s["failed"]}


CALIBRATION_RATES = (0.5, 1.5)   # x --rate: the calibration runs load the cluster below and above the study
CALIBRATION_SEED = 1             # the study's requests are seed 0's


def calibration_run(run_dir: Path, rate: float, sessions: int) -> None:
    """The study's workload at ``rate`` with seed ``CALIBRATION_SEED``, served by the real cluster with
    round_robin, its files written into ``run_dir`` (what ``calibrate`` reads)."""
    served = ServedCluster.real(ClusterConfig(replicas=REPLICAS), "round_robin", EngineConfig(**ENGINE),
                                allocator="prefix")
    logger = JsonlLogger()
    config = {"engine": dict(ENGINE), "model": {"path": None}, "attention": {"name": "cpu"},
              "cluster": {"replicas": REPLICAS}, "router": {"name": "round_robin"}}
    logger.start(run_dir, config, name=run_dir.name)
    try:
        workload = generate_workload(workload_config(sessions, rate, seed=CALIBRATION_SEED), served.engine.tokenizer)
        served.serve(workload, loggers=[logger], progress=False)
    finally:
        logger.finish()
        served.close()


def calibrate_cluster(out: Path, rate: float, sessions: int) -> dict:
    """Serve the calibration runs on the real cluster and fit the profile into ``out``."""
    runs = Path(tempfile.mkdtemp(prefix="cluster_calibration_"))
    run_dirs = []
    for factor in CALIBRATION_RATES:
        run_dir = runs / f"multi_turn_rate{rate * factor:g}_seed{CALIBRATION_SEED}"
        print(f"calibration run: {run_dir.name}", flush=True)
        calibration_run(run_dir, rate * factor, sessions)
        run_dirs.append(run_dir)
    profile = calibrate(run_dirs, out, command="python experiments/cluster_real_vs_sim.py (its calibration step)")
    print(f"profile: {out} ({profile['num_steps']} steps, R^2 {profile['fit']['r2']:.3f})", flush=True)
    return profile


def run(kind: str, router: str, rate: float, sessions: int, profile: Path | None = None) -> dict[str, float]:
    cluster, config = ClusterConfig(replicas=REPLICAS), EngineConfig(**ENGINE)
    if kind == "real":
        served = ServedCluster.real(cluster, router, config, allocator="prefix")
    else:
        runner = {"name": "sim", "step_time": "calibrated", "profile": str(profile) if profile else None}
        served = ServedCluster.simulated(cluster, router, runner, None, config, allocator="prefix")
    try:
        workload = generate_workload(workload_config(sessions, rate), served.engine.tokenizer)
        return figures(served.serve(workload, progress=False))
    finally:
        served.close()


def ranking(rows: dict[str, dict[str, float]]) -> list[str]:
    return sorted(rows, key=lambda router: rows[router]["p50_ttft_ms"])


def resolved_pairs(real_runs: dict[str, list[dict[str, float]]]) -> list[tuple[str, str]]:
    """The (faster, slower) router pairs whose real mean p50 TTFTs differ by more than twice the standard error
    of their difference over the rounds: the orderings the real runs resolve. Closer pairs are ties: no
    simulator could be held to an order the real cluster itself does not show reliably."""
    stats = {}
    for router, runs in real_runs.items():
        values = [run["p50_ttft_ms"] for run in runs]
        se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("inf")
        stats[router] = (statistics.fmean(values), se)
    pairs = []
    for a in real_runs:
        for b in real_runs:
            (mean_a, se_a), (mean_b, se_b) = stats[a], stats[b]
            if mean_a < mean_b and mean_b - mean_a > 2 * (se_a ** 2 + se_b ** 2) ** 0.5:
                pairs.append((a, b))
    return pairs


def report(data: dict) -> str:
    """The results page, from what ``measure`` recorded (``--from-json`` renders it again)."""
    real_runs, sim, routers = data["real_runs"], data["sim"], list(data["real_runs"])
    calibration_rates = ", ".join(f"{data['rate'] * factor:g}" for factor in CALIBRATION_RATES)
    real = {router: {key: statistics.fmean(run[key] for run in runs) for key in runs[0]}
            for router, runs in real_runs.items()}
    lines = [f"# Routers at {REPLICAS} real replicas and in the simulator ({data['wall_s']:.0f} s of wall time)", "",
             f"`{data['command']}`", "", f"{data['header']} | one torch thread per replica", "",
             f"Simulated on `{data['profile']}`, fitted on real 2-replica runs of this workload with round_robin "
             f"at {calibration_rates} req/s, seed {CALIBRATION_SEED} "
             "(the compared runs: seed 0, every router; see the script's docstring).", "",
             "| router | requests | real tok/s | sim tok/s | sim/real | real p50 TTFT ms | sim p50 TTFT ms | "
             "sim/real | real hit rate | sim hit rate | failed (real, sim) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for router in routers:
        r, s = real[router], sim[router]
        tok, ttft = s["tok_s"] / r["tok_s"], s["p50_ttft_ms"] / r["p50_ttft_ms"]
        worst = max(worst, abs(tok - 1), abs(ttft - 1))
        lines.append(f"| {router} | {r['requests']:.0f} | {r['tok_s']:.1f} | {s['tok_s']:.1f} | {tok:.3f} | "
                     f"{r['p50_ttft_ms']:,.0f} | {s['p50_ttft_ms']:,.0f} | {ttft:.3f} | {r['hit_rate']:.3f} | "
                     f"{s['hit_rate']:.3f} | {r['failed']:.0f}, {s['failed']:.0f} |")
    real_rank, sim_rank = ranking(real), ranking(sim)
    pairs = resolved_pairs(real_runs)
    agree = [(a, b) for a, b in pairs if sim[a]["p50_ttft_ms"] < sim[b]["p50_ttft_ms"]]
    tied = [(a, b) for i, a in enumerate(routers) for b in routers[i + 1:]
            if (a, b) not in pairs and (b, a) not in pairs]
    lines += ["", f"Largest sim/real error: {100 * worst:.1f}%.", "",
              f"Ranked by p50 TTFT (means), real: {' < '.join(real_rank)}; sim: {' < '.join(sim_rank)}; "
              f"the same order: {'yes' if real_rank == sim_rank else 'no'}.", "",
              f"Orderings the real runs resolve (mean p50 TTFTs more than 2 standard errors apart over "
              f"{len(next(iter(real_runs.values())))} rounds): {len(pairs)}; the simulator orders "
              f"{len(agree)} of them the same"
              + (": " + ", ".join(f"{a} < {b}" for a, b in pairs) if pairs else "") + ". Ties in the real runs: "
              + (", ".join(f"{a} ~ {b}" for a, b in tied) if tied else "none") + ".", "",
              "Real runs, per round (p50 TTFT ms / output tok/s):", ""]
    lines += [f"- {router}: " + ", ".join(f"{run['p50_ttft_ms']:,.0f} / {run['tok_s']:.1f}" for run in runs)
              for router, runs in real_runs.items()]
    return "\n".join(lines) + "\n"


def measure(args: argparse.Namespace, out: Path) -> dict:
    """Calibrate (unless ``--profile``), then the real rounds and one simulation per router."""
    import torch

    torch.set_num_threads(1)   # the driver runs no model; each replica (and so each simulated one) has one thread
    routers = args.routers.split(",")
    header = machine.header(1)
    print(header, flush=True)
    started = time.perf_counter()
    if args.profile:
        profile_path = Path(args.profile)
    else:
        profile_path = out.with_name(out.stem + "_profile.yaml")
        calibrate_cluster(profile_path, args.rate, args.sessions)
    real_runs: dict[str, list[dict[str, float]]] = {router: [] for router in routers}
    sim: dict[str, dict[str, float]] = {}
    for round_index in range(args.rounds):
        for router in routers:
            real_runs[router].append(run("real", router, args.rate, args.sessions))
            print(f"round {round_index} {router} real {real_runs[router][-1]}", flush=True)
            if router not in sim:  # the simulation is deterministic: one run per router
                sim[router] = run("sim", router, args.rate, args.sessions, profile_path)
                print(f"{router} sim {sim[router]}", flush=True)
    command = "python experiments/cluster_real_vs_sim.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k not in ("out", "profile", "from_json") and v is not None)
    return {"command": command, "header": header, "rate": args.rate, "profile": profile_path.name,
            "wall_s": time.perf_counter() - started, "real_runs": real_runs, "sim": sim}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routers", default="round_robin,least_loaded,consistent_hash,cache_aware")
    parser.add_argument("--rate", type=float, default=8.0, help="requests/s for the whole cluster")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--profile", default=None, help="a profile fitted before (skips the calibration runs)")
    parser.add_argument("--from-json", default=None, help="render the page again from a recorded .json")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    write_page(args, Path(args.out), measure, report)


def write_page(args: argparse.Namespace, out: Path, measure: Callable[[argparse.Namespace, Path], dict],
               report: Callable[[dict], str]) -> None:
    """Measure (or read the measurements ``--from-json`` names), keep them beside ``out`` as ``.json``, and write
    and print the page ``report`` makes of them."""
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
    else:
        data = measure(args, out)
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    text = report(data)
    out.write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out} (and the measurements in {out.with_suffix('.json').name})")


if __name__ == "__main__":
    main()
