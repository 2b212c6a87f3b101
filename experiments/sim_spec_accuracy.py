"""Simulated speculative decoding against the real engine: ``ngram`` and ``draft`` at two loads.

    python experiments/sim_spec_accuracy.py [--dtype bfloat16] [--methods ngram,draft] [--rounds 1]

For each proposer: real calibration runs (chat workload, workload seed 1, a low and a high rate), a profile
calibrated on them (``python -m nanovllm.harness.sim.calibrate``: the target's step terms fitted with the
proposals as prompt-like rows, plus the proposer's own cost) and an acceptance model fitted on them
(``runner.acceptance=fitted``: each simulated request draws one calibration request's proposal rate, proposal
length and acceptance rate); then the held-out real runs (workload seed 0, the same two rates) and their
simulation with that profile and acceptance model. The held-out runs are never used to fit anything; the
simulation takes only each request's output length from them (chat requests end at EOS, which only the model
knows), as ``sim_accuracy.py`` does. Prints, and writes to ``experiments/results/sim_spec_accuracy_<dtype>.md``,
output throughput and p50 TPOT real against simulated and the error (target: within 15%), with the acceptance
rate of each. A second simulation replays each held-out request's own recorded acceptance
(``runner.acceptance=replay``), which isolates the pricing from the acceptance model. ``--rounds R`` repeats the held-out real runs R times and compares with their mean.

Every real run uses one torch thread and ``engine.max_num_seqs=8`` (``this_machine.run_engine``). Run files go
under ``experiments/results/sim_runs/spec/<dtype>/`` (not tracked); finished runs (with a ``metrics.json``) are
reused, so an interrupted measurement resumes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from nanovllm.harness.sim.this_machine import run_engine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
WITHIN = 0.15
CHAT = ["workload=chat", "workload.max_tokens=48"]
LOADS = {   # name -> workload overrides (the rate and how many requests)
    "low": ["workload.num_requests=10", "workload.request_rate=0.2"],
    "high": ["workload.num_requests=24", "workload.request_rate=3"],
}
METRICS = [("output tok/s", "output_throughput"), ("p50 TPOT ms", "median_tpot_ms")]


def runs_dir(dtype: str) -> Path:
    return RESULTS / "sim_runs" / "spec" / dtype


def real(overrides: list[str], run_dir: Path, dtype: str) -> Path:
    """One real run (reused when it finished before)."""
    if not (run_dir / "metrics.json").is_file():
        run_engine(overrides, run_dir, dtype, threads=1, cwd=ROOT)
    return run_dir


def simulate(overrides: list[str], run_dir: Path, dtype: str, profile: Path, acceptance: str, acceptance_run: Path,
             lengths_from: Path) -> Path:
    """The simulation of one held-out workload: the calibrated profile, ``runner.acceptance=acceptance`` of
    ``acceptance_run``, output lengths from the real run."""
    command = [sys.executable, "-m", "nanovllm.run", *overrides, "runner=sim", f"runner.profile={profile}",
               f"runner.acceptance={acceptance}", f"runner.acceptance_run={acceptance_run}",
               f"runner.output_lengths_from={lengths_from}", "engine.max_num_seqs=8", "progress=false",
               "monitor.calibrate=false", f"engine.dtype={dtype}", f"hydra.run.dir={run_dir}"]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return run_dir


def merged_calibration_run(runs: list[Path], out: Path) -> Path:
    """One directory holding the calibration runs' request records together (what ``runner.acceptance_run``
    reads), with the first run's config and metrics; request ids are prefixed by the run so none collide."""
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, run in enumerate(runs):
        for line in (run / "requests.jsonl").read_text().splitlines():
            record = json.loads(line)
            record["request_id"] = f"{i}:{record['request_id']}"
            lines.append(json.dumps(record))
    (out / "requests.jsonl").write_text("\n".join(lines) + "\n")
    (out / "steps.jsonl").write_text("")
    for name in ("config.json", "metrics.json"):
        (out / name).write_text((runs[0] / name).read_text())
    return out


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--methods", default="ngram,draft")
    parser.add_argument("--rounds", type=int, default=1, help="real runs of each held-out case (their mean)")
    parser.add_argument("--knee-rows", default="fit",
                        help="the calibration's bend in the step cost (calibrate --knee-rows: fit, a row count, 0)")
    args = parser.parse_args()
    base = runs_dir(args.dtype)
    rows = []
    for method in args.methods.split(","):
        spec = [f"speculative={method}"]
        calib = [real([*CHAT, *spec, *load, "workload.seed=1"], base / f"{method}_calib_{name}", args.dtype)
                 for name, load in LOADS.items()]
        profile = base / f"{method}_profile.yaml"
        subprocess.run([sys.executable, "-m", "nanovllm.harness.sim.calibrate", *map(str, calib), "--out",
                        str(profile), "--knee-rows", str(args.knee_rows)], check=True, cwd=ROOT)
        accept_run = merged_calibration_run(calib, base / f"{method}_calib_requests")
        for name, load in LOADS.items():
            overrides = [*CHAT, *spec, *load, "workload.seed=0"]
            reals = [real(overrides, base / f"{method}_{name}_real_r{r}", args.dtype)
                     for r in range(1, args.rounds + 1)]
            sim = simulate(overrides, base / f"{method}_{name}_sim", args.dtype, profile, "fitted", accept_run,
                           reals[0])
            # The pricing alone: each request's own recorded acceptance (the held-out run's), same profile.
            replayed = simulate(overrides, base / f"{method}_{name}_sim_replay", args.dtype, profile, "replay",
                                reals[0], reals[0])
            rows.append((method, name, [metrics(r) for r in reals], metrics(sim), metrics(replayed)))
    lines = [f"dtype={args.dtype}, chat workload (max_tokens 48), max_num_seqs=8, K=3, policy fixed; held-out "
             f"real runs: workload seed 0, {args.rounds} round(s); calibration and acceptance: seed 1; "
             f"calibrate --knee-rows {args.knee_rows}", "",
             "| proposer | load | metric | real | simulated (fitted acceptance) | error | simulated (replayed "
             "acceptance) | error | acceptance real / fitted / replayed |",
             "|---|---|---|---|---|---|---|---|---|"]
    worst = {"fitted": 0.0, "replayed": 0.0}
    for method, load, reals, sim, replayed in rows:
        for label, key in METRICS:
            real_value = statistics.mean(m[key] for m in reals)
            error, error_replayed = sim[key] / real_value - 1.0, replayed[key] / real_value - 1.0
            worst["fitted"] = max(worst["fitted"], abs(error))
            worst["replayed"] = max(worst["replayed"], abs(error_replayed))
            accept = (f"{statistics.mean(m['spec_decode_acceptance_rate'] or 0 for m in reals):.2f} / "
                      f"{sim['spec_decode_acceptance_rate'] or 0:.2f} / "
                      f"{replayed['spec_decode_acceptance_rate'] or 0:.2f}")
            lines.append(f"| {method} | {load} | {label} | {real_value:,.1f} | {sim[key]:,.1f} | {error:+.1%} | "
                         f"{replayed[key]:,.1f} | {error_replayed:+.1%} | {accept} |")
    lines.append("")
    for kind, value in worst.items():
        lines.append(f"largest error, {kind} acceptance: {value:.1%} "
                     f"({'within' if value <= WITHIN else 'NOT within'} {WITHIN:.0%})")
    text = "\n".join(lines)
    print(text)
    (RESULTS / f"sim_spec_accuracy_{args.dtype}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
