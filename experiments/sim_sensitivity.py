"""How much one compared workload's metrics move when every step takes a few percent longer or shorter.

    python experiments/sim_sensitivity.py [--workload bursty_priorities] [--dtype bfloat16] [--factors 0.96,1.04]

Simulates the workload of ``experiments/sim_accuracy.py`` under fcfs and priority with the shipped profile of the
dtype scaled by each factor (every coefficient, the intercept and the step gap), each request's output length taken
from the first real run, and tabulates the same metrics next to every real run of ``sim_accuracy.py measure`` and
their mean (the errors are against the mean) into ``results/sim_sensitivity_D_WORKLOAD.md``. A metric that jumps
between neighbouring factors depends on which side of a step boundary an arrival lands, not on the step-time model's
accuracy: run-to-run noise of the real engine (a few percent per step on this shared machine) moves it as much. The
real runs are read from ``experiments/results/sim_runs/D/``, unpacked on first use from the dtype's archive
``experiments/results/sim_runs_D.tar.xz``; the simulated runs go to a temporary directory (the table is what is kept).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import yaml
from sim_accuracy import DTYPES, METRICS, POLICIES, WORKLOADS, Setup

from nanovllm.serving.records import read_metrics

DEFAULT_FACTORS = (0.96, 0.97, 0.98, 0.99, 1.0, 1.01, 1.02, 1.03, 1.04)


def scaled_profile(profile: Path, factor: float, out: Path) -> Path:
    """``profile`` with every step taking ``factor`` times as long."""
    data = yaml.safe_load(profile.read_text(encoding="utf-8"))
    data["intercept"] *= factor
    data["step_gap"] = data.get("step_gap", 0.0) * factor
    data["coefficients"] = {name: value * factor for name, value in data["coefficients"].items()}
    out.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return out


def sensitivity(setup: Setup, workload: str, factors: list[float]) -> str:
    overrides = WORKLOADS[workload]
    header = "| policy | run | " + " | ".join(label for label, _ in METRICS) + " |"
    rows = [header, "|" + "---|" * (len(METRICS) + 2)]
    with tempfile.TemporaryDirectory() as tmp:
        for policy in POLICIES:
            real_dirs = sorted(setup.runs.glob(f"{workload}_{policy}_real_r*"))
            if not real_dirs or not all(read_metrics(d) for d in real_dirs):
                raise SystemExit(f"error: no finished real runs {workload}_{policy}_real_r* in {setup.runs}; run "
                                 "experiments/sim_accuracy.py measure first")
            reals = [read_metrics(d) for d in real_dirs]
            for real_dir, metrics in zip(real_dirs, reals):
                cells = [f"{metrics[key]:,.1f}" for _, key in METRICS]
                rows.append(f"| {policy} | real ({real_dir.name}) | " + " | ".join(cells) + " |")
            real = {key: statistics.fmean(r[key] for r in reals) for _, key in METRICS}
            rows.append(f"| {policy} | real mean | " + " | ".join(f"{real[key]:,.1f}" for _, key in METRICS) + " |")
            for factor in factors:
                profile = scaled_profile(setup.profile, factor, Path(tmp) / f"profile_{factor}.yaml")
                sim_dir = Path(tmp) / f"{policy}_{factor}"
                setup.run([*overrides, "workload.seed=0", f"scheduler={policy}", "runner=sim",
                           f"runner.profile={profile}", f"runner.output_lengths_from={real_dirs[0]}"], sim_dir)
                sim = read_metrics(sim_dir)
                cells = [f"{sim[key]:,.1f} ({(sim[key] - real[key]) / real[key]:+.0%})" for _, key in METRICS]
                rows.append(f"| {policy} | simulated, step times x{factor:.2f} | " + " | ".join(cells) + " |")
    intro = (f"Made by `python experiments/sim_sensitivity.py --workload {workload} --dtype {setup.dtype}` (on the "
             f"real runs of `experiments/sim_accuracy.py measure`): the shipped profile `{setup.profile.name}` with "
             "every step time scaled by the factor; each request's output length from the first real run; errors "
             f"against the mean of the real runs (`{workload}_<policy>_real_r*`).")
    title = f"# Simulator sensitivity: {workload} ({setup.dtype}) with every step a few percent longer or shorter"
    return "\n".join([title, "", intro, "", *rows, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="bursty_priorities")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--factors", default=",".join(map(str, DEFAULT_FACTORS)),
                        help="comma-separated step-time scale factors")
    args = parser.parse_args()
    try:
        factors = [float(f) for f in args.factors.split(",")]
    except ValueError:
        raise SystemExit(f"error: --factors must be comma-separated numbers, got {args.factors!r}") from None
    if any(f <= 0 for f in factors):
        raise SystemExit(f"error: --factors must be positive, got {args.factors!r}")
    setup = Setup(args.dtype)
    text = sensitivity(setup, args.workload, factors)
    out = setup.table.with_name(f"sim_sensitivity_{args.dtype}_{args.workload}.md")
    out.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
