"""Calibrate the simulator on this machine and compare it with the real engine, under a protocol in which the
machine's drift hits calibration and comparison alike.

    python experiments/sim_accuracy.py measure [--dtype D] [--repeats R] [--rounds K,...]  # the real runs
    python experiments/sim_accuracy.py calibrate [--dtype D] [--repeats R]  # fit the shipped profile on them
    python experiments/sim_accuracy.py compare [--dtype D] [--repeats R] [--profiles shipped|leave-one-out]
    python experiments/sim_accuracy.py all [--dtype D] [--repeats R]        # measure, calibrate, compare, pack
    python experiments/sim_accuracy.py extract|pack [--dtype D]   # unpack the runs' archive / write it anew

D: bfloat16 (default, the engine's) or float32; R: 3 by default. Every run, real and simulated, uses
``engine.dtype=D`` (and the default attention backend); one profile is shipped per dtype.

``measure`` makes R rounds of real runs, interleaved: round k serves the two calibration workloads with workload
seed k (``calib_<name>_seed<k>``), then the three compared workloads (chat at a low and a saturating Poisson rate,
a bursty synthetic workload with two priority classes; seed 0) under fcfs and priority (``<workload>_<policy>
_real_r<k>``). A slow or fast period of this shared machine therefore lands in calibration and comparison runs
alike, instead of in whichever block of runs happened to be made during it. Finished runs (with a
``metrics.json``) are reused, so an interrupted measurement resumes; ``--rounds`` makes only the rounds named.
``calibrate`` fits the shipped profile ``nanovllm/harness/sim/profiles/smollm2-135m-D-cpu.yaml`` on every
calibration run (seeds 1..R: never seed 0, which the compared runs use). ``compare`` simulates each compared
workload and policy once -- with the shipped profile, or (``leave-one-out``) with a profile fitted on the other two
compared workloads' real runs (all rounds, both policies) -- taking each request's output length from the first
round's real run (chat requests end at EOS, which only the model knows; the table says whether the R real runs
agree on every length), and tabulates p50/p90 TTFT, p50 TPOT, p50 E2E latency and output throughput: the mean,
min, max and spread ((max - min) / mean) of the R real runs, the simulated value and its error against the real
mean, and how many of the single real runs it is within 15% of. It also lists, per real run, its total step time
against the profile's prediction for the same steps (the machine's drift, run by run), and the step features of
the compared runs outside the profile's fitted range. Run files go under
``experiments/results/sim_runs/D/``, which is not tracked: the runs are kept as one archive per dtype,
``experiments/results/sim_runs_D.tar.xz``, unpacked there on first use (checked against the SHA-256 the shipped
profile records in ``runs_archive``), so ``compare`` reproduces the tables from a fresh clone. ``pack`` writes the
archive from that directory after new runs and records its name and SHA-256 in the shipped profile; ``all`` ends
with it. ``extract`` only unpacks. Every run uses one torch thread (``OMP_NUM_THREADS=1``): on this shared
2-core machine two OpenMP threads competing with other processes spin and make steps up to tenfold slower and
erratic, so the profile describes the engine with one thread.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from nanovllm.harness.sim import runs_archive
from nanovllm.harness.sim.step_time import default_profile_path
from nanovllm.harness.sim.this_machine import CALIBRATION_WORKLOADS, run_engine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
DTYPES = ("bfloat16", "float32")
DEFAULT_REPEATS = 5  # = this_machine.FULL_ROUNDS, the protocol of `calibrate --this-machine --full`
WITHIN = 0.15
REAL_RUN_THREADS = 1  # every real run's torch threads (see the module docstring)

# Calibration workloads (shared with `calibrate --this-machine`); their workload seed is the round's number
# (1..R), never the compared runs' 0.
CALIBRATION = CALIBRATION_WORKLOADS
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
_UNPACKED: set[str] = set()  # dtypes whose archive this process has checked and unpacked


@dataclass(frozen=True)
class Setup:
    """Where one dtype's runs, profile and table go, and how its runs are named."""

    dtype: str

    @property
    def runs(self) -> Path:
        """The dtype's run directory, unpacked from ``archive`` on first use (and when the archive changes)."""
        if self.archive.is_file() and self.dtype not in _UNPACKED:
            recorded = runs_archive.runs_archive(self.profile) if self.profile.is_file() else None
            expected = recorded["sha256"] if recorded and recorded["file"] == self.archive_name else None
            runs_archive.ensure_extracted(self.archive, sha256=expected)
            _UNPACKED.add(self.dtype)
        return RESULTS / "sim_runs" / self.dtype

    @property
    def archive(self) -> Path:
        """The one archive holding every run file of this dtype (``sim_runs/D/...``, seeds included)."""
        return RESULTS / f"sim_runs_{self.dtype}.tar.xz"

    @property
    def archive_name(self) -> str:
        """``archive`` as the shipped profile records it: relative to the repository root."""
        return self.archive.relative_to(ROOT).as_posix()

    @property
    def profile(self) -> Path:
        return default_profile_path(self.dtype)

    @property
    def table(self) -> Path:
        return RESULTS / f"sim_accuracy_{self.dtype}.md"

    def calibration_dir(self, name: str, seed: int) -> Path:
        """The run of calibration workload ``name`` with workload seed ``seed`` (made in round ``seed``)."""
        return self.runs / f"{name}_seed{seed}"

    def real_dir(self, workload: str, policy: str, round_: int) -> Path:
        """The real run of a compared workload and policy made in round ``round_`` (1..R; workload seed 0)."""
        return self.runs / f"{workload}_{policy}_real_r{round_}"

    def run(self, overrides: list[str], run_dir: Path) -> None:
        run_engine(overrides, run_dir, self.dtype, threads=REAL_RUN_THREADS, cwd=ROOT)


def measure(setup: Setup, rounds: list[int]) -> None:
    """Make the real runs of each round in ``rounds``: the calibration workloads (seed = the round), then every
    compared workload and policy (seed 0). Finished runs are reused."""
    import json

    from nanovllm import machine
    from nanovllm.serving.records import read_metrics

    info = machine.describe(REAL_RUN_THREADS)
    print(machine.header(info=info), flush=True)
    for round_ in rounds:
        todo = [(overrides + [f"workload.seed={round_}"], setup.calibration_dir(name, round_))
                for name, overrides in CALIBRATION.items()]
        todo += [([*overrides, "workload.seed=0", f"scheduler={policy}"], setup.real_dir(workload, policy, round_))
                 for workload, overrides in WORKLOADS.items() for policy in POLICIES]
        todo = [(overrides, run_dir) for overrides, run_dir in todo if not read_metrics(run_dir)]
        if todo:  # where this round's runs are made (a round may be measured on another day, or machine)
            setup.runs.mkdir(parents=True, exist_ok=True)
            (setup.runs / f"machine_r{round_}.json").write_text(
                json.dumps({"round": round_, "machine": info}, indent=2) + "\n", encoding="utf-8")
        for overrides, run_dir in todo:
            setup.run(overrides, run_dir)


def finished(run_dirs: list[Path]) -> list[Path]:
    """``run_dirs``, or a SystemExit naming the first one without a ``metrics.json`` (run ``measure`` first)."""
    from nanovllm.serving.records import read_metrics

    for run_dir in run_dirs:
        if not read_metrics(run_dir):
            raise SystemExit(f"error: {run_dir.relative_to(ROOT)} has no metrics.json: run `measure` first")
    return run_dirs


def calibrate(setup: Setup, repeats: int) -> None:
    """Fit the shipped profile on every calibration run of rounds 1..``repeats``."""
    dirs = finished([setup.calibration_dir(name, seed) for seed in range(1, repeats + 1) for name in CALIBRATION])
    subprocess.run([sys.executable, "-m", "nanovllm.harness.sim.calibrate",
                    *(str(d.relative_to(ROOT)) for d in dirs), "--out", str(setup.profile.relative_to(ROOT))],
                   check=True, cwd=ROOT)


def pack(setup: Setup) -> None:
    """Write the dtype's archive from ``sim_runs/D/`` and record its name and SHA-256 in the shipped profile."""
    digest = runs_archive.pack(RESULTS, [f"sim_runs/{setup.dtype}"], setup.archive)
    runs_archive.record_runs_archive(setup.profile, setup.archive_name, digest)
    print(f"wrote {setup.archive_name} (SHA-256 {digest}); recorded in {setup.profile.relative_to(ROOT)}")


def output_lengths(run_dir: Path) -> dict[str, int]:
    """Request id -> number of output tokens, from a run's ``requests.jsonl``."""
    from nanovllm.serving.records import read_run

    return {r["request_id"]: r["num_output_tokens"] for r in read_run(run_dir, missing_ok=False).requests}


def against_profile(run_dir: Path, profile: Path, dtype: str) -> tuple[float, list[str]]:
    """The run's total step time (steps that did work) over what ``profile`` predicts for the same steps (above
    1: the machine ran slower than in the profile's runs, below 1 faster), and the features whose values in the
    run's steps leave the profile's ``feature_range`` (there the profile extrapolates)."""
    from nanovllm.serving.records import read_run
    from nanovllm.harness.sim.step_time import CalibratedStepTime, with_kernel_features, working_steps

    model = CalibratedStepTime(profile, dtype=dtype)
    steps = working_steps(read_run(run_dir, missing_ok=False).steps)
    predicted = sum(model.predict(s, 0.0) - model.step_gap for s in steps)
    rows = [with_kernel_features(s, model.gemv_max_rows) for s in steps]
    outside = [name for name, (low, high) in model.profile["feature_range"].items()
               if min(r[name] for r in rows) < low or max(r[name] for r in rows) > high]
    return sum(s["duration"] for s in steps) / predicted, outside


def compare(setup: Setup, repeats: int, profiles: str = "shipped") -> None:
    """Simulate each compared workload and policy with the shipped profile, or (``leave-one-out``: another
    *workload*, not only other runs) with a profile fitted on the other two compared workloads' real runs, and
    write the table against the ``repeats`` real runs of each."""
    from nanovllm.serving.records import read_metrics
    from nanovllm.harness.sim.calibrate import calibrate as fit

    rounds = range(1, repeats + 1)
    real_dirs = {(w, p): finished([setup.real_dir(w, p, k) for k in rounds]) for w in WORKLOADS for p in POLICIES}
    rows = [("| workload | policy | metric | real mean | real min | real max | real spread | simulated | error vs "
            "real mean | single runs within 15% |"), "|---|---|---|---|---|---|---|---|---|---|"]
    drift = ["| workload | policy | " + " | ".join(f"round {k}" for k in rounds) + " | output lengths agree | features "
             "outside the profile's range |", "|---|---|" + "---|" * repeats + "---|---|"]
    errors, singles = [], []
    suffix = "sim" if profiles == "shipped" else "sim_loo"
    for workload, overrides in WORKLOADS.items():
        if profiles == "shipped":
            profile = setup.profile
        else:
            others = [d for (w, _), dirs in real_dirs.items() if w != workload for d in dirs]
            profile = setup.runs / f"profile_without_{workload}.yaml"
            fit(others, profile, command="leave-one-workload-out fit in experiments/sim_accuracy.py")
        for policy in POLICIES:
            dirs = real_dirs[workload, policy]
            sim_dir = setup.runs / f"{workload}_{policy}_{suffix}"
            setup.run([*overrides, "workload.seed=0", f"scheduler={policy}", "runner=sim",
                       f"runner.profile={profile}", f"runner.output_lengths_from={dirs[0]}"], sim_dir)
            reals, sim = [read_metrics(d) for d in dirs], read_metrics(sim_dir)
            for label, key in METRICS:
                values = [r[key] for r in reals]
                mean = statistics.fmean(values)
                error = (sim[key] - mean) / mean
                hits = sum(abs(sim[key] - v) <= WITHIN * v for v in values)
                errors.append(abs(error))
                singles.append(hits)
                rows.append(f"| {workload} | {policy} | {label} | {mean:,.1f} | {min(values):,.1f} | "
                            f"{max(values):,.1f} | {(max(values) - min(values)) / mean:.1%} | {sim[key]:,.1f} | "
                            f"{error:+.1%} | {hits} of {len(values)} |")
            checks = [against_profile(d, profile, setup.dtype) for d in dirs]
            agree = "yes" if all(output_lengths(d) == output_lengths(dirs[0]) for d in dirs[1:]) else "no"
            outside = sorted({name for _, names in checks for name in names})
            drift.append(f"| {workload} | {policy} | " + " | ".join(f"{ratio:.3f}" for ratio, _ in checks)
                         + f" | {agree} | {', '.join(outside) or 'none'} |")
    how = ("the shipped profile of this dtype (fitted on the calibration workloads' runs, seeds 1.."
           f"{repeats}, made interleaved with the compared runs: never the runs compared)" if profiles == "shipped"
           else "a profile fitted on the other two workloads' real runs only (all rounds, both policies: leave "
                "one workload out)")
    runs = len(errors) * repeats
    text = "\n".join([
        f"# Simulator accuracy: calibrated simulator vs the real engine ({setup.dtype}, {profiles} profile)", "",
        (f"Made by `python experiments/sim_accuracy.py compare --dtype {setup.dtype} --repeats {repeats} --profiles "
        f"{profiles}` after `measure`: {repeats} rounds of real runs (engine.dtype={setup.dtype}, one torch thread), "
        "each round the calibration workloads (seed = the round) and then three workloads under fcfs and priority "
        f"(seed 0); each workload simulated with {how}, with each request's output length taken from round 1's "
        f"real run. **{sum(e <= WITHIN for e in errors)} of {len(errors)} figures within 15% of the real mean; "
        f"{sum(singles)} of {runs} single real runs within 15% of the simulated figure; median absolute error vs "
        f"the mean {statistics.median(errors):.1%}, largest {max(errors):.1%}.**"), "", *rows, "",
        ("Per real run: its total step time over what the profile predicts for the same steps (above 1: the machine "
         "ran slower than in the profile's runs); whether the real runs agree on every request's output length; "
         "which step features of theirs leave the range the profile was fitted on (there it extrapolates)."),
        "", *drift, ""])
    table = setup.table if profiles == "shipped" else setup.table.with_name(f"{setup.table.stem}_leave_one_out.md")
    table.write_text(text, encoding="utf-8")
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="all",
                        choices=("measure", "calibrate", "compare", "pack", "extract", "all"))
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="engine.dtype of every real and simulated run (one shipped profile per dtype)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help="rounds of real runs: calibration seeds 1..R, each compared case R times")
    parser.add_argument("--rounds", default=None,
                        help="measure: comma-separated rounds to make (default: 1..R), e.g. to hold a lock per round")
    parser.add_argument("--profiles", choices=("shipped", "leave-one-out"), default="shipped",
                        help="compare: simulate with the shipped profile, or with one fitted on the other workloads")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"error: --repeats must be at least 1, got {args.repeats}")
    try:
        rounds = (list(range(1, args.repeats + 1)) if args.rounds is None
                  else sorted({int(k) for k in args.rounds.split(",")}))
    except ValueError:
        raise SystemExit(f"error: --rounds must be comma-separated integers, got {args.rounds!r}") from None
    if not all(1 <= k <= args.repeats for k in rounds):
        raise SystemExit(f"error: --rounds must lie in 1..{args.repeats} (--repeats), got {args.rounds}")
    setup = Setup(args.dtype)
    if args.what in ("measure", "all"):
        measure(setup, rounds)
    if args.what in ("calibrate", "all"):
        calibrate(setup, args.repeats)
    if args.what in ("compare", "all"):
        compare(setup, args.repeats, args.profiles)
    if args.what == "extract":
        print(f"{setup.runs.relative_to(ROOT)}: unpacked from {setup.archive_name}")
    if args.what in ("pack", "all"):
        pack(setup)


if __name__ == "__main__":
    main()
