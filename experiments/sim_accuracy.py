"""Calibrate the simulator on this machine, then compare it with the real engine.

    python experiments/sim_accuracy.py calibrate   # real calibration runs -> the shipped profile
    python experiments/sim_accuracy.py compare     # real vs simulated runs -> experiments/results/sim_accuracy.md
    python experiments/sim_accuracy.py all

``calibrate`` serves two workloads on the real engine (seed 1) and fits the shipped profile
``nanovllm/harness/sim/profiles/smollm2-135m-float32-cpu.yaml`` from their ``steps.jsonl``. ``compare`` serves
three workloads (chat at a low and a saturating Poisson rate, a bursty synthetic workload with two priority
classes; seed 0) under fcfs and priority on the real engine, then simulates each workload with a profile
fitted on the other workloads' real runs only, and tabulates p50/p90 TTFT, p50 TPOT, p50 E2E latency and
output throughput with the simulator's error. The simulated runs take each request's output length from the
real run they are compared with (chat requests end at EOS, which only the model knows); the step times come
from the profile alone. Finished real runs are reused when the script is run again. Run files go under
``experiments/results/sim_runs/``. Every run uses one torch thread (``OMP_NUM_THREADS=1``): on this shared
2-core machine two OpenMP threads competing with other processes spin and make steps up to tenfold slower and
erratic, so the profile describes the engine with one thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "experiments" / "results" / "sim_runs"
PROFILE = ROOT / "nanovllm" / "harness" / "sim" / "profiles" / "smollm2-135m-float32-cpu.yaml"
TABLE = ROOT / "experiments" / "results" / "sim_accuracy.md"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
ENGINE = ["engine.max_num_seqs=8", "progress=false", "monitor.calibrate=false"]

CALIBRATION = {
    "calib_synthetic": ["workload=synthetic", "workload.num_requests=40", "workload.request_rate=3",
                        "workload.input_len.kind=uniform", "workload.input_len.mean=200",
                        "workload.input_len.range_ratio=0.9", "workload.output_len.kind=uniform",
                        "workload.output_len.mean=32", "workload.output_len.range_ratio=0.8", "workload.seed=1"],
    "calib_chat": ["workload=chat", "workload.num_requests=24", "workload.request_rate=2", "workload.max_tokens=64",
                   "workload.seed=1"],
}
WORKLOADS = {
    "chat_low": ["workload=chat", "workload.num_requests=16", "workload.request_rate=0.5", "workload.max_tokens=48"],
    "chat_saturating": ["workload=chat", "workload.num_requests=24", "workload.request_rate=4",
                        "workload.max_tokens=48"],
    "bursty_priorities": ["workload=synthetic", "workload.num_requests=24", "workload.request_rate=2",
                          "workload.burstiness=0.3", "workload.input_len.kind=uniform", "workload.input_len.mean=128",
                          "workload.input_len.range_ratio=0.5", "workload.output_len.kind=uniform",
                          "workload.output_len.mean=32", "workload.output_len.range_ratio=0.5",
                          "workload.priority_classes=[0,1]", "workload.priority_weights=[0.25,0.75]"],
}
POLICIES = ("fcfs", "priority")
METRICS = [("p50 TTFT ms", "median_ttft_ms"), ("p90 TTFT ms", "p90_ttft_ms"), ("p50 TPOT ms", "median_tpot_ms"),
           ("p50 E2E ms", "median_e2el_ms"), ("output tok/s", "output_throughput")]


def run(overrides: list[str], run_dir: Path) -> None:
    command = [sys.executable, "-m", "nanovllm.run", *overrides, *ENGINE, f"hydra.run.dir={run_dir}"]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, **ONE_THREAD})


def calibrate() -> None:
    dirs = []
    for name, overrides in CALIBRATION.items():
        run(overrides, RUNS / name)
        dirs.append(str((RUNS / name).relative_to(ROOT)))
    subprocess.run([sys.executable, "-m", "nanovllm.harness.sim.calibrate", *dirs, "--out",
                    str(PROFILE.relative_to(ROOT))], check=True, cwd=ROOT)


def compare(reuse: bool = True) -> None:
    """Real runs first (all of them, back to back, so they share the machine's conditions), then for each
    workload a profile fitted on the *other* workloads' real runs (leave one workload out: the calibration
    data are never the runs compared) and the simulated runs with it."""
    from nanovllm.harness.records import read_metrics
    from nanovllm.harness.sim.calibrate import calibrate as fit

    for workload, overrides in WORKLOADS.items():
        for policy in POLICIES:
            real_dir = RUNS / f"{workload}_{policy}_real"
            if not (reuse and read_metrics(real_dir)):
                run([*overrides, f"scheduler={policy}"], real_dir)
    rows = ["| workload | policy | metric | real | simulated | error |", "|---|---|---|---|---|---|"]
    errors = []
    for workload, overrides in WORKLOADS.items():
        others = [RUNS / f"{w}_{p}_real" for w in WORKLOADS if w != workload for p in POLICIES]
        profile = RUNS / f"profile_without_{workload}.yaml"
        fit(others, profile, command="leave-one-workload-out fit in experiments/sim_accuracy.py")
        for policy in POLICIES:
            real_dir, sim_dir = RUNS / f"{workload}_{policy}_real", RUNS / f"{workload}_{policy}_sim"
            run([*overrides, f"scheduler={policy}", "runner=sim", f"runner.profile={profile}",
                 f"runner.output_lengths_from={real_dir}"], sim_dir)
            real, sim = read_metrics(real_dir), read_metrics(sim_dir)
            for label, key in METRICS:
                error = (sim[key] - real[key]) / real[key]
                errors.append(abs(error))
                rows.append(f"| {workload} | {policy} | {label} | {real[key]:,.1f} | {sim[key]:,.1f} | {error:+.1%} |")
    within = sum(e <= 0.15 for e in errors)
    text = "\n".join([
        "# Simulator accuracy: calibrated simulator vs the real engine", "",
        "Made by `python experiments/sim_accuracy.py compare`: real runs (seed 0, one torch thread) of three "
        "workloads under fcfs and priority; each workload simulated with a profile fitted on the other two "
        "workloads' real runs only (leave one workload out), with each request's output length taken from the "
        f"real run. {within} of {len(errors)} figures within 15%; median absolute error "
        f"{sorted(errors)[len(errors) // 2]:.1%}, largest {max(errors):.1%}.", "", *rows, ""])
    TABLE.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what in ("calibrate", "all"):
        calibrate()
    if what in ("compare", "all"):
        compare()
