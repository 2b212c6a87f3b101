"""The simulator against the real engine over several workload seeds, for a workload whose single-seed figures
hinge on where arrivals fall between steps (see ``sim_sensitivity.py``).

    python experiments/sim_seeds.py [--workload bursty_priorities] [--dtype bfloat16] [--seeds 0,1,2,3,4]
                                    [--profiles shipped|leave-one-seed-out]

For each seed and policy (fcfs, priority) of a workload of ``experiments/sim_accuracy.py``: a real run (finished
ones are reused; seed 0 is ``sim_accuracy``'s round-1 run) and a simulation with the shipped profile of the dtype,
or (``leave-one-seed-out``) with a profile fitted on the other seeds' real runs only -- runs made in the same
session as the ones compared, so a change of the machine's speed since the shipped profile's calibration runs does
not count as the simulator's error. Each request's output length is taken from its real run. The table
(``results/sim_seeds_D_WORKLOAD.md``) gives every seed's figures and error, and the mean of each figure over the
seeds, real and simulated, with its error. Run files go under ``experiments/results/sim_runs/D/seeds/`` (seed 0's
real run is ``sim_accuracy``'s round-1 run, ``<workload>_<policy>_real_r1``), unpacked on first use from the dtype's
archive ``experiments/results/sim_runs_D.tar.xz``; ``python experiments/sim_accuracy.py pack --dtype D`` writes it
anew after new runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sim_accuracy import DTYPES, METRICS, POLICIES, WORKLOADS, Setup

from nanovllm.serving.records import read_metrics


def real_dir(setup: Setup, workload: str, policy: str, seed: int) -> Path:
    if seed == 0:
        return setup.real_dir(workload, policy, 1)
    return setup.runs / "seeds" / f"{workload}_{policy}_seed{seed}_real"


def seeds_table(setup: Setup, workload: str, seeds: list[int], profiles: str = "shipped") -> str:
    from nanovllm.harness.sim.calibrate import calibrate

    overrides = WORKLOADS[workload]
    figures: dict[tuple[str, int], tuple[dict, dict]] = {}
    for seed in seeds:  # real runs first, back to back, as in sim_accuracy
        for policy in POLICIES:
            real = real_dir(setup, workload, policy, seed)
            if not read_metrics(real):
                setup.run([*overrides, f"workload.seed={seed}", f"scheduler={policy}"], real)
    suffix = "sim" if profiles == "shipped" else "sim_loso"
    for seed in seeds:
        profile = setup.profile
        if profiles != "shipped":
            others = [real_dir(setup, workload, p, s) for s in seeds if s != seed for p in POLICIES]
            profile = setup.runs / "seeds" / f"profile_without_seed{seed}.yaml"
            calibrate(others, profile, command="leave-one-seed-out fit in experiments/sim_seeds.py")
        for policy in POLICIES:
            real = real_dir(setup, workload, policy, seed)
            sim = setup.runs / "seeds" / f"{workload}_{policy}_seed{seed}_{suffix}"
            setup.run([*overrides, f"workload.seed={seed}", f"scheduler={policy}", "runner=sim",
                       f"runner.profile={profile}", f"runner.output_lengths_from={real}"], sim)
            figures[policy, seed] = read_metrics(real), read_metrics(sim)
    rows = ["| policy | seed | " + " | ".join(f"{label}: real / sim (error)" for label, _ in METRICS) + " |",
            "|" + "---|" * (len(METRICS) + 2)]
    summary = []
    for policy in POLICIES:
        for seed in seeds:
            real, sim = figures[policy, seed]
            cells = [f"{real[key]:,.1f} / {sim[key]:,.1f} ({(sim[key] - real[key]) / real[key]:+.1%})"
                     for _, key in METRICS]
            rows.append(f"| {policy} | {seed} | " + " | ".join(cells) + " |")
        cells = []
        for _, key in METRICS:
            real_mean = sum(figures[policy, s][0][key] for s in seeds) / len(seeds)
            sim_mean = sum(figures[policy, s][1][key] for s in seeds) / len(seeds)
            error = (sim_mean - real_mean) / real_mean
            summary.append(abs(error))
            cells.append(f"{real_mean:,.1f} / {sim_mean:,.1f} ({error:+.1%})")
        rows.append(f"| {policy} | **mean** | " + " | ".join(cells) + " |")
    within = sum(e <= 0.15 for e in summary)
    how = (f"the shipped profile `{setup.profile.name}`" if profiles == "shipped" else
           "a profile fitted on the other seeds' real runs only (both policies)")
    intro = (f"Made by `python experiments/sim_seeds.py --workload {workload} --dtype {setup.dtype} --seeds "
             f"{','.join(map(str, seeds))} --profiles {profiles}`: real runs (engine.dtype={setup.dtype}, one torch "
             f"thread) of the workload with each workload seed, each simulated with {how} and the real run's output "
             f"lengths. Means over the {len(seeds)} seeds: {within} of {len(summary)} figures within 15%.")
    title = f"# Simulator accuracy over workload seeds: {workload} ({setup.dtype}, {profiles} profile)"
    return "\n".join([title, "", intro, "", *rows, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="bursty_priorities")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated workload seeds")
    parser.add_argument("--profiles", choices=("shipped", "leave-one-seed-out"), default="shipped",
                        help="simulate with the shipped profile, or with one fitted on the other seeds' real runs")
    args = parser.parse_args()
    try:
        seeds = sorted({int(s) for s in args.seeds.split(",")})
    except ValueError:
        raise SystemExit(f"error: --seeds must be comma-separated integers, got {args.seeds!r}") from None
    setup = Setup(args.dtype)
    text = seeds_table(setup, args.workload, seeds, args.profiles)
    tail = "" if args.profiles == "shipped" else "_leave_one_seed_out"
    out = setup.table.with_name(f"sim_seeds_{args.dtype}_{args.workload}{tail}.md")
    out.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
