"""The simulator on quantized runs: this machine calibrated per engine setting, against the real engine.

    python experiments/sim_quantized.py [--settings int8,int8-kv8] [--repeats 2] [--out DIR]

For the dense bf16 engine and each setting (``int8``: ``engine.quantization=int8``; ``int8-kv8``: that and
``engine.kv_cache_dtype=int8``; ``gguf``: the default model's own Q4_1 blocks), ``calibrate --this-machine``
fits a profile here (``nanovllm.harness.sim.calibrate.calibrate_this_machine``: the shipped profiles'
calibration workloads, one round, one torch thread). Then each compared workload of ``sim_accuracy.py``
(``WORKLOADS``, fcfs, workload seed 0, never a calibration seed) is served for real ``--repeats`` times with the
setting, and simulated twice with the real first run's output lengths: with the setting's own profile (what
``runner=sim`` picks up once it is calibrated) and with the dense profile (what a quantized simulation used
before, and still uses with a warning where its setting is not calibrated). The table gives each metric's
real mean and both simulated values with their error against it, so it shows what calibrating the setting
buys. Everything runs on one torch thread (``OMP_NUM_THREADS=1``), as ``sim_accuracy.py``; pin it to a core
(``taskset -c 1``) on a shared machine. Profiles and runs go under ``--out`` (default a temporary directory), not
into this machine's profile cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_accuracy import METRICS, WORKLOADS  # noqa: E402

from nanovllm import machine  # noqa: E402
from nanovllm.harness.sim.calibrate import calibrate_this_machine  # noqa: E402
from nanovllm.harness.sim.this_machine import (  # noqa: E402
    profile_name,
    run_engine,
    settings_overrides,
)
from nanovllm.serving.records import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DTYPE = "bfloat16"
THREADS = 1
SETTINGS = {  # name -> (engine.quantization, engine.kv_cache_dtype)
    "int8": ("int8", "auto"),
    "int8-kv8": ("int8", "int8"),
    "gguf": ("gguf", "auto"),
}


def error(sim: float, real: float) -> str:
    return f"{(sim - real) / real:+.1%}" if real else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="int8,int8-kv8", help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--repeats", type=int, default=2, help="real runs of each workload and setting")
    parser.add_argument("--out", default=None, help="directory for the profiles and runs (default: a temporary one)")
    args = parser.parse_args()
    names = [name.strip() for name in args.settings.split(",") if name.strip()]
    unknown = [name for name in names if name not in SETTINGS]
    if unknown or args.repeats < 1:
        parser.error(f"--settings takes {', '.join(SETTINGS)} (got {', '.join(unknown)}); --repeats >= 1")
    out = Path(args.out or tempfile.mkdtemp(prefix="sim_quantized_"))
    info = machine.describe(THREADS)
    print(f"CPU: {info['cpu']} | ISA: {info['isa']} | threads: {THREADS} | copy bandwidth: "
          f"{info['copy_bandwidth_gbs']:.1f} GB/s | runs under {out}", flush=True)

    def calibrated(quantization: str | None, kv_cache_dtype: str) -> Path:
        path = out / profile_name(DTYPE, quantization, kv_cache_dtype)
        profile, _ = calibrate_this_machine(DTYPE, THREADS, out=path, echo=False, quantization=quantization,
                                            kv_cache_dtype=kv_cache_dtype)
        fit = profile["fit"]
        print(f"calibrated {path.name}: {profile['num_steps']} steps, median |error| "
              f"{fit['median_abs_rel_error']:.1%}", flush=True)
        return path

    dense = calibrated(None, "auto")
    rows = []
    for name in names:
        quantization, kv_cache_dtype = SETTINGS[name]
        own = calibrated(quantization, kv_cache_dtype)
        settings = settings_overrides(quantization, kv_cache_dtype)
        for workload, overrides in WORKLOADS.items():
            base = [*overrides, "workload.seed=0", "scheduler=fcfs", *settings]
            reals = []
            for repeat in range(1, args.repeats + 1):
                real_dir = out / f"{name}_{workload}_real_r{repeat}"
                run_engine(base, real_dir, DTYPE, THREADS, cwd=ROOT, echo=False)
                reals.append(read_metrics(real_dir))
            sims = {}
            for label, profile in (("own", own), ("dense", dense)):
                sim_dir = out / f"{name}_{workload}_sim_{label}"
                run_engine([*base, "runner=sim", f"runner.profile={profile}",
                            f"runner.output_lengths_from={out / f'{name}_{workload}_real_r1'}"], sim_dir, DTYPE,
                           THREADS, cwd=ROOT, echo=False)
                sims[label] = read_metrics(sim_dir)
            for label, key in METRICS:
                real = statistics.fmean(r[key] for r in reals)
                spread = (max(r[key] for r in reals) - min(r[key] for r in reals)) / real if real else 0.0
                rows.append((name, workload, label, real, spread, sims["own"][key], sims["dense"][key]))
            print(f"{name} {workload}: done", flush=True)
    print(f"\n| setting | workload | metric | real (mean of {args.repeats}) | real spread | sim, own profile | "
          "error | sim, dense profile | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, workload, label, real, spread, own_value, dense_value in rows:
        print(f"| {name} | {workload} | {label} | {real:.1f} | {spread:.0%} | {own_value:.1f} | "
              f"{error(own_value, real)} | {dense_value:.1f} | {error(dense_value, real)} |")
    within = sum(abs(own_value - real) <= 0.15 * real for *_, real, _, own_value, _ in rows)
    within_dense = sum(abs(dense_value - real) <= 0.15 * real for *_, real, _, _, dense_value in rows)
    print(f"\nwithin 15% of the real mean: own profile {within}/{len(rows)}, dense profile "
          f"{within_dense}/{len(rows)}")


if __name__ == "__main__":
    main()
