"""The failure-rate study's real point: 2 real replicas on this machine with replicas killed at a given rate, and
the simulator's run of the same configuration (this machine's profile, the same deaths at the same times) beside
it: goodput and p50/p99 TTFT, real and simulated, and the simulator's error.

    python experiments/cluster_faults_real_point.py [--failure-rates 0,240] [--rate 2] [--seconds 60] [--seed 0]

Every run serves the same synthetic workload (Poisson arrivals at ``--rate`` req/s for ``--seconds``, prompts
``--input`` +- 50% tokens, outputs ``--output`` +- 50%, ``ignore_eos``; seed ``--seed``) with the default model in
bfloat16 on 2 replicas behind ``least_loaded`` (``ENGINE``; ``cluster.max_retries=3``, restarts unbounded):

* real: ``ServedCluster.real`` (2 engines in Ray actors, the router in this process, the wall clock). Each
  replica dies as a Poisson process at the failure rate (deaths per replica per hour), drawn from the stream
  ``cluster.faults.rate`` uses for that seed and replica; at each drawn time a thread kills the replica's actor
  (``RayCluster.kill_replica``, as a crash would) if it is up (a death drawn while it is down is void, as in the
  simulator). The dead replica is relaunched and rejoins when its model has loaded; the time from the kill to
  the rejoin is measured.
* sim: ``ServedCluster.simulated`` with the step-time profile fitted on a real fault-free run of this
  workload with seed ``--seed + 1`` (``calibrate``: nothing fitted on the compared runs), the kills of the real
  run as ``cluster.faults.deaths`` at the same times, and ``cluster.faults.restart_delay`` the real run's mean
  kill-to-rejoin time (the fault-free restart delay: 0 kills).

Goodput: requests/s that completed within TTFT <= ``--ttft-slo-ms`` and TPOT <= ``--tpot-slo-ms`` over the time
from the first arrival to the last end. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from nanovllm import machine  # noqa: E402
from nanovllm.cluster.config import ClusterConfig  # noqa: E402
from nanovllm.config import EngineConfig  # noqa: E402
from nanovllm.harness.cluster import ServedCluster  # noqa: E402
from nanovllm.harness.sim.calibrate import calibrate  # noqa: E402
from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, generate_workload  # noqa: E402
from nanovllm.serving.loggers import JsonlLogger  # noqa: E402
from nanovllm.serving.metrics import is_completed, tpot_s, ttft_s  # noqa: E402

REPLICAS = 2
ENGINE = dict(num_kv_blocks=512, max_num_seqs=16, dtype="bfloat16")
ROUTER = "least_loaded"


def workload(args: argparse.Namespace, seed: int, tokenizer) -> list:  # type: ignore[no-untyped-def]
    return generate_workload(SyntheticWorkloadConfig(
        num_requests=int(args.rate * args.seconds), request_rate=args.rate, seed=seed,
        input_len=LengthDist(kind="uniform", mean=args.input, range_ratio=0.5),
        output_len=LengthDist(kind="uniform", mean=args.output, range_ratio=0.5)), tokenizer)


def death_times(failure_rate: float, seed: int, seconds: float) -> list[tuple[float, int]]:
    """(time, replica) of each replica's Poisson deaths within ``seconds``, drawn as ``cluster.faults.rate``
    draws them (``FaultInjector``: one stream per replica, ``seed * 1_000_003 + replica``)."""
    if failure_rate <= 0:
        return []
    deaths = []
    for replica in range(REPLICAS):
        stream, t = random.Random(seed * 1_000_003 + replica), 0.0
        while True:
            t += stream.expovariate(failure_rate / 3600.0)
            if t >= seconds:
                break
            deaths.append((t, replica))
    return sorted(deaths)


def figures(records: list, args: argparse.Namespace) -> dict:
    start = min(r["arrival_time"] for r in records)
    end = max(r["finish_time"] or start for r in records)
    good = sum(1 for r in records if is_completed(r) and ttft_s(r) * 1e3 <= args.ttft_slo_ms
               and (tpot_s(r) is None or tpot_s(r) * 1e3 <= args.tpot_slo_ms))
    ttfts = np.array([ttft_s(r) for r in records if is_completed(r)]) * 1e3
    return {"requests": len(records), "failed": sum(r["error"] is not None for r in records),
            "retried": sum(r["num_retries"] >= 1 for r in records), "goodput_req_s": good / (end - start),
            "p50_ttft_ms": float(np.percentile(ttfts, 50)), "p99_ttft_ms": float(np.percentile(ttfts, 99))}


class Killer(threading.Thread):
    """Kills replica actors at the drawn times (seconds after ``start``) when they are up, and times each one's
    relaunch (the kill to the driver seeing it alive again)."""

    def __init__(self, served: ServedCluster, deaths: list[tuple[float, int]]) -> None:
        super().__init__(daemon=True)
        self.cluster, self.deaths = served.engine, deaths
        self.kills: list[tuple[float, int]] = []
        self.restarts: list[float] = []
        self.stop = threading.Event()
        self.start_time = 0.0

    def run(self) -> None:
        # replica -> (when it was killed, whether the driver has seen it dead yet): the driver finds a death at
        # the replica's next answer, and sees it alive again when its relaunched actor has loaded the model.
        pending: dict[int, tuple[float, bool]] = {}
        deaths = list(self.deaths)
        while not self.stop.wait(0.05):
            now = time.perf_counter() - self.start_time
            for replica, (killed, seen_dead) in list(pending.items()):
                alive = self.cluster.replicas[replica].alive
                if not alive and not seen_dead:
                    pending[replica] = (killed, True)
                elif alive and seen_dead:
                    self.restarts.append(now - killed)
                    del pending[replica]
            while deaths and deaths[0][0] <= now:
                t, replica = deaths.pop(0)
                if replica in pending:   # down already: void, as in the simulator
                    continue
                self.cluster.kill_replica(replica)
                self.kills.append((t, replica))
                pending[replica] = (t, False)


def real_run(args: argparse.Namespace, seed: int, deaths: list[tuple[float, int]],
             run_dir: Path | None = None) -> tuple[dict, list[tuple[float, int]], list[float]]:
    """One real 2-replica run with ``deaths``; its figures, the kills made and the measured restart times.
    ``run_dir``: write the run's files there (a calibration run)."""
    served = ServedCluster.real(ClusterConfig(replicas=REPLICAS, max_retries=3, max_restarts=1000), ROUTER,
                                EngineConfig(**ENGINE))
    loggers = []
    if run_dir is not None:
        logger = JsonlLogger()
        logger.start(run_dir, {"engine": dict(ENGINE), "model": {"path": None}, "attention": {"name": "cpu"},
                               "cluster": {"replicas": REPLICAS}, "router": {"name": ROUTER}}, name=run_dir.name)
        loggers.append(logger)
    killer = Killer(served, deaths)
    try:
        requests = workload(args, seed, served.engine.tokenizer)
        killer.start_time = time.perf_counter()
        killer.start()
        result = served.serve(requests, loggers=loggers, progress=False)
    finally:
        killer.stop.set()
        killer.join(5)
        for logger in loggers:
            logger.finish()
        served.close()
    return figures(result.requests, args), killer.kills, killer.restarts


def sim_run(args: argparse.Namespace, seed: int, kills: list[tuple[float, int]], restart_delay: float,
            profile: Path) -> dict:
    faults = {"deaths": [{"replica": r, "time": t} for t, r in kills], "restart_delay": restart_delay}
    served = ServedCluster.simulated(
        ClusterConfig(replicas=REPLICAS, max_retries=3, max_restarts=1000, faults=faults), ROUTER,
        {"name": "sim", "step_time": "calibrated", "profile": str(profile)}, None, EngineConfig(**ENGINE))
    return figures(served.serve(workload(args, seed, served.engine.tokenizer)).requests, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failure-rates", default="0,240", help="deaths per replica per hour")
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s for the whole cluster")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--input", type=int, default=256)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=200.0)
    parser.add_argument("--profile", default=None, help="a profile fitted before (skips the calibration run)")
    args = parser.parse_args()
    # On a shared machine other jobs' memory can cross Ray's threshold (95% of the node) and Ray's monitor would
    # kill a replica: a death this study did not draw. Only the kills drawn here happen (the kernel's OOM killer
    # still guards the machine).
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    import torch

    torch.set_num_threads(1)   # the driver runs no model
    print(machine.header(1), flush=True)
    started = time.perf_counter()
    if args.profile:
        profile = Path(args.profile)
    else:
        runs = Path(tempfile.mkdtemp(prefix="faults_real_point_"))
        run_dir = runs / f"synthetic_rate{args.rate:g}_seed{args.seed + 1}"
        calibration, _, _ = real_run(args, args.seed + 1, [], run_dir)
        profile = runs / "profile.yaml"
        fit = calibrate([run_dir], profile, command="python experiments/cluster_faults_real_point.py (calibration)")
        print(f"calibration run {calibration}; profile {profile} ({fit['num_steps']} steps, R^2 "
              f"{fit['fit']['r2']:.3f})", flush=True)
    rows = []
    for failure_rate in map(float, args.failure_rates.split(",")):
        real, kills, restarts = real_run(args, args.seed, death_times(failure_rate, args.seed, args.seconds))
        delay = statistics.fmean(restarts) if restarts else 0.0
        sim = sim_run(args, args.seed, kills, delay, profile)
        print(f"{failure_rate:g}/replica-hour: kills {[(round(t, 1), r) for t, r in kills]}, relaunch s "
              f"{[round(s, 1) for s in restarts]}\n  real {real}\n  sim  {sim}", flush=True)
        rows.append((failure_rate, kills, delay, real, sim))
    print(f"\n{time.perf_counter() - started:.0f} s of wall time\n")
    print("| failures / replica / hour | kills (s: replica) | relaunch s | failed real, sim | resumed real, sim | "
          "goodput req/s real | sim | p50 TTFT ms real | sim | p99 TTFT ms real | sim |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for failure_rate, kills, delay, real, sim in rows:
        def err(key: str) -> str:
            return f"{sim[key]:,.2f} ({100 * (sim[key] / real[key] - 1):+.0f}%)" if real[key] else "-"
        print(f"| {failure_rate:g} | {', '.join(f'{t:.1f}: {r}' for t, r in kills) or '-'} | {delay:.1f} | "
              f"{real['failed']}, {sim['failed']} | {real['retried']}, {sim['retried']} | "
              f"{real['goodput_req_s']:.2f} | {err('goodput_req_s')} | {real['p50_ttft_ms']:,.0f} | "
              f"{err('p50_ttft_ms')} | {real['p99_ttft_ms']:,.0f} | {err('p99_ttft_ms')} |")


if __name__ == "__main__":
    main()
