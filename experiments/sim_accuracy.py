"""Calibrate the simulator on this machine, then compare it with the real engine.

    python experiments/sim_accuracy.py calibrate [--dtype D]  # real calibration runs -> the shipped profile
    python experiments/sim_accuracy.py compare [--dtype D]    # real vs simulated -> results/sim_accuracy_D.md
    python experiments/sim_accuracy.py all [--dtype D]        # D: bfloat16 (default, the engine's) or float32
    python experiments/sim_accuracy.py spread [--dtype D] [--repeats 2]  # the real engine's own run-to-run spread

Every run, real and simulated, uses ``engine.dtype=D`` (and the default attention backend); one profile is
shipped per dtype. ``calibrate`` serves two workloads on the real engine (seed 1) and fits the shipped profile
``nanovllm/harness/sim/profiles/smollm2-135m-D-cpu.yaml`` from their ``steps.jsonl``. ``compare`` serves
three workloads (chat at a low and a saturating Poisson rate, a bursty synthetic workload with two priority
classes; seed 0) under fcfs and priority on the real engine, then simulates each workload with a profile
fitted on the other workloads' real runs only, and tabulates p50/p90 TTFT, p50 TPOT, p50 E2E latency and
output throughput with the simulator's error. The simulated runs take each request's output length from the
real run they are compared with (chat requests end at EOS, which only the model knows); the step times come
from the profile alone. Finished real runs (calibration and compared ones) are reused when the script is run
again: delete them to measure the engine afresh. Run files go under
``experiments/results/sim_runs/D/``. Every run uses one torch thread (``OMP_NUM_THREADS=1``): on this shared
2-core machine two OpenMP threads competing with other processes spin and make steps up to tenfold slower and
erratic, so the profile describes the engine with one thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from nanovllm.harness.sim.step_time import default_profile_path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
DTYPES = ("bfloat16", "float32")
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


@dataclass(frozen=True)
class Setup:
    """Where one dtype's runs, profile and table go."""

    dtype: str

    @property
    def runs(self) -> Path:
        return RESULTS / "sim_runs" / self.dtype

    @property
    def profile(self) -> Path:
        return default_profile_path(self.dtype)

    @property
    def table(self) -> Path:
        return RESULTS / f"sim_accuracy_{self.dtype}.md"

    def run(self, overrides: list[str], run_dir: Path) -> None:
        command = [sys.executable, "-m", "nanovllm.run", *overrides, *ENGINE, f"engine.dtype={self.dtype}",
                   f"hydra.run.dir={run_dir}"]
        print("$", " ".join(command[1:]), flush=True)
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, **ONE_THREAD})


def calibrate(setup: Setup, reuse: bool = True) -> None:
    """Serve the calibration workloads on the real engine (finished runs are reused: delete them to re-measure,
    e.g. after the engine changed) and fit the shipped profile on them."""
    from nanovllm.harness.records import read_metrics

    dirs = []
    for name, overrides in CALIBRATION.items():
        if not (reuse and read_metrics(setup.runs / name)):
            setup.run(overrides, setup.runs / name)
        dirs.append(str((setup.runs / name).relative_to(ROOT)))
    subprocess.run([sys.executable, "-m", "nanovllm.harness.sim.calibrate", *dirs, "--out",
                    str(setup.profile.relative_to(ROOT))], check=True, cwd=ROOT)


def compare(setup: Setup, profiles: str = "shipped", reuse: bool = True) -> None:
    """Real runs first (all of them, back to back, so they share the machine's conditions), then the simulated
    runs of each workload with the step times from a profile fitted on other runs than the ones compared:

    - ``shipped``: the shipped profile of this dtype, fitted on the two calibration workloads' runs (seed 1);
    - ``leave-one-out`` (stricter: another *workload*, not only other runs): a profile fitted on the other two
      compared workloads' real runs, so each workload's step shapes are extrapolated from the others'.
    """
    from nanovllm.harness.records import read_metrics
    from nanovllm.harness.sim.calibrate import calibrate as fit

    runs = setup.runs
    for workload, overrides in WORKLOADS.items():
        for policy in POLICIES:
            real_dir = runs / f"{workload}_{policy}_real"
            if not (reuse and read_metrics(real_dir)):
                setup.run([*overrides, f"scheduler={policy}"], real_dir)
    rows = ["| workload | policy | metric | real | simulated | error |", "|---|---|---|---|---|---|"]
    errors = []
    suffix = "sim" if profiles == "shipped" else "sim_loo"
    for workload, overrides in WORKLOADS.items():
        if profiles == "shipped":
            profile = setup.profile
        else:
            others = [runs / f"{w}_{p}_real" for w in WORKLOADS if w != workload for p in POLICIES]
            profile = runs / f"profile_without_{workload}.yaml"
            fit(others, profile, command="leave-one-workload-out fit in experiments/sim_accuracy.py")
        for policy in POLICIES:
            real_dir, sim_dir = runs / f"{workload}_{policy}_real", runs / f"{workload}_{policy}_{suffix}"
            setup.run([*overrides, f"scheduler={policy}", "runner=sim", f"runner.profile={profile}",
                       f"runner.output_lengths_from={real_dir}"], sim_dir)
            real, sim = read_metrics(real_dir), read_metrics(sim_dir)
            for label, key in METRICS:
                error = (sim[key] - real[key]) / real[key]
                errors.append(abs(error))
                rows.append(f"| {workload} | {policy} | {label} | {real[key]:,.1f} | {sim[key]:,.1f} | {error:+.1%} |")
    within = sum(e <= 0.15 for e in errors)
    how = ("the shipped profile of this dtype (fitted on the calibration workloads' runs, seed 1: never the runs "
           "compared)" if profiles == "shipped" else
           "a profile fitted on the other two workloads' real runs only (leave one workload out)")
    text = "\n".join([
        f"# Simulator accuracy: calibrated simulator vs the real engine ({setup.dtype}, {profiles} profile)", "",
        f"Made by `python experiments/sim_accuracy.py compare --dtype {setup.dtype} --profiles {profiles}`: real "
        f"runs (engine.dtype={setup.dtype}, seed 0, one torch thread) of three workloads under fcfs and priority; "
        f"each workload simulated with {how}, with each request's output length taken from the real run. "
        f"{within} of {len(errors)} figures within 15%; median absolute error "
        f"{sorted(errors)[len(errors) // 2]:.1%}, largest {max(errors):.1%}.", "", *rows, ""])
    table = setup.table if profiles == "shipped" else setup.table.with_name(f"{setup.table.stem}_leave_one_out.md")
    table.write_text(text, encoding="utf-8")
    print(text)


def spread(setup: Setup, repeats: int = 2) -> None:
    """The real engine against itself: each compared workload and policy served ``repeats`` more times, back to
    back (run dirs ``<workload>_<policy>_real_r1`` ...; finished ones are reused), next to the run ``compare``
    made. Tabulates each figure's lowest and highest real value and their spread ((max - min) / mean), and the
    simulator's error (shipped profile, the ``compare`` run) against the mean of the real runs: how far a single
    real run is from another tells how close any simulator can be expected to come to it."""
    from nanovllm.harness.records import read_metrics

    runs = setup.runs
    rows = ["| workload | policy | metric | real runs | real min | real max | real spread | simulated | error vs "
            "real mean |", "|---|---|---|---|---|---|---|---|---|"]
    spreads, errors = [], []
    for workload, overrides in WORKLOADS.items():
        for policy in POLICIES:
            dirs = [runs / f"{workload}_{policy}_real"] + [runs / f"{workload}_{policy}_real_r{i}"
                                                            for i in range(1, repeats + 1)]
            if not read_metrics(dirs[0]):
                raise SystemExit(f"error: {dirs[0]} has no metrics.json: run `compare` first")
            for run_dir in dirs[1:]:
                if not read_metrics(run_dir):
                    setup.run([*overrides, f"scheduler={policy}"], run_dir)
            reals = [read_metrics(d) for d in dirs]
            sim = read_metrics(runs / f"{workload}_{policy}_sim")
            for label, key in METRICS:
                values = [r[key] for r in reals]
                mean = statistics.fmean(values)
                spreads.append((max(values) - min(values)) / mean)
                errors.append((sim[key] - mean) / mean)
                rows.append(f"| {workload} | {policy} | {label} | {len(values)} | {min(values):,.1f} | "
                            f"{max(values):,.1f} | {spreads[-1]:.1%} | {sim[key]:,.1f} | {errors[-1]:+.1%} |")
    text = "\n".join([
        f"# The real engine's own run-to-run spread ({setup.dtype}) and the simulator against its mean", "",
        f"Made by `python experiments/sim_accuracy.py spread --dtype {setup.dtype} --repeats {repeats}`: each "
        f"compared workload and policy served {repeats + 1} times on the real engine (seed 0, one torch thread; the "
        "first run is the one `compare` made); the simulated run is `compare`'s with the shipped profile. "
        f"Real spread above 15% in {sum(s > 0.15 for s in spreads)} of {len(spreads)} figures (median "
        f"{statistics.median(spreads):.1%}, largest {max(spreads):.1%}); simulator within 15% of the real mean in "
        f"{sum(abs(e) <= 0.15 for e in errors)} of {len(errors)} (median |error| "
        f"{statistics.median(abs(e) for e in errors):.1%}, largest {max(abs(e) for e in errors):.1%}).", "",
        *rows, ""])
    (RESULTS / f"sim_spread_{setup.dtype}.md").write_text(text, encoding="utf-8")
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=("calibrate", "compare", "all", "spread"),
                        default="all")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="engine.dtype of every real and simulated run (one shipped profile per dtype)")
    parser.add_argument("--profiles", choices=("shipped", "leave-one-out"), default="shipped",
                        help="compare: simulate with the shipped profile, or with one fitted on the other workloads")
    parser.add_argument("--repeats", type=int, default=2, help="spread: real runs made beyond compare's")
    args = parser.parse_args()
    setup = Setup(args.dtype)
    if args.what in ("calibrate", "all"):
        calibrate(setup)
    if args.what in ("compare", "all"):
        compare(setup, args.profiles)
    if args.what == "spread":
        spread(setup, args.repeats)


if __name__ == "__main__":
    main()
