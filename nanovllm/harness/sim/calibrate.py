"""Fit the ``calibrated`` step-time model from real runs' ``steps.jsonl``::

    python -m nanovllm.harness.sim.calibrate RUN_DIR [RUN_DIR ...] --out profile.yaml

Non-negative least squares (``scipy.optimize.nnls``) of each step's duration on a per-step intercept and the
features the engine records (``CALIBRATION_FEATURES``), so every feature can only add time. The profile keeps
the coefficients, the range of every feature seen, the fit's error, the command that made it and the runs'
model, ``dtype`` and attention backend (the simulator refuses a profile of another dtype than the run's).

A calibration the simulator could not trust stops with one ``error:`` line naming the cause: fewer than
``MIN_STEPS`` steps, or a feature that never varies across the steps (nothing to fit it from: e.g. runs with
no prefill at all).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml
from scipy.optimize import nnls

from nanovllm.harness.records import read_config, read_run
from nanovllm.harness.sim.step_time import CALIBRATION_FEATURES

MIN_STEPS = 30


def fit_profile(steps: Sequence[dict[str, Any]], *, source: str = "", metadata: dict | None = None) -> dict:
    """The profile (a plain dict, as written to YAML) fitted on ``steps``; ``ValueError`` naming the problem."""
    if len(steps) < MIN_STEPS:
        raise ValueError(f"calibration needs at least {MIN_STEPS} steps, got {len(steps)} {source}".rstrip())
    features = np.array([[float(s[f]) for f in CALIBRATION_FEATURES] for s in steps])
    for j, name in enumerate(CALIBRATION_FEATURES):
        if np.ptp(features[:, j]) == 0:
            raise ValueError(f"calibration: feature {name} is {features[0, j]:g} in every step, so its cost "
                             "cannot be fitted; record runs whose steps vary it (e.g. prefill and decode steps)")
    durations = np.array([float(s["duration"]) for s in steps])
    design = np.hstack([np.ones((len(steps), 1)), features])
    # Scale columns to comparable size so the solver's tolerance treats every feature alike.
    scale = np.abs(design).max(axis=0)
    solution, _ = nnls(design / scale, durations)
    coefficients = solution / scale
    predicted = design @ coefficients
    relative = np.abs(predicted - durations) / np.maximum(durations, 1e-9)
    residual = float(np.sum((durations - predicted) ** 2))
    total = float(np.sum((durations - durations.mean()) ** 2)) or 1.0
    return {
        "step_time": "calibrated",
        **(metadata or {}),
        "num_steps": len(steps),
        "intercept": float(coefficients[0]),
        "coefficients": {name: float(c) for name, c in zip(CALIBRATION_FEATURES, coefficients[1:])},
        "feature_range": {name: [float(features[:, j].min()), float(features[:, j].max())]
                          for j, name in enumerate(CALIBRATION_FEATURES)},
        "fit": {"r2": 1.0 - residual / total, "median_abs_rel_error": float(np.median(relative)),
                "p90_abs_rel_error": float(np.quantile(relative, 0.9))},
    }


def run_setup(run_dir: str | Path) -> dict[str, Any]:
    """What a profile depends on besides the batch, from the run's ``config.json``: the model (None: the
    default one), ``dtype`` and attention backend; {} for a run without a config (written from Python)."""
    config = read_config(run_dir) or {}
    if not config:
        return {}
    return {"model": (config.get("model") or {}).get("path"), "dtype": (config.get("engine") or {}).get("dtype"),
            "attention": (config.get("attention") or {}).get("name")}


def calibrate(run_dirs: Sequence[str | Path], out: str | Path, command: str | None = None) -> dict:
    """Fit on every step of ``run_dirs`` and write the profile to ``out``; returns it. The profile records
    the runs' model, dtype and attention backend (``run_setup``); runs in different dtypes are an error (one
    profile describes one dtype's step times)."""
    steps: list[dict] = []
    configs = []
    setups = []
    for run_dir in run_dirs:
        data = read_run(run_dir, missing_ok=False)
        steps.extend(s for s in data.steps if s["num_prefill_tokens"] + s["num_decode_seqs"] > 0)
        configs.append(data.metrics.get("simulated", False))
        setups.append(run_setup(run_dir))
    if any(configs):
        raise ValueError("calibration: a run directory holds a simulated run; calibrate from real runs only")
    dtypes = sorted({str(setup["dtype"]) for setup in setups if setup.get("dtype")})
    if len(dtypes) > 1:
        raise ValueError(f"calibration: the runs use different engine.dtype ({', '.join(dtypes)}); a profile "
                         "describes one dtype, so calibrate each from its own runs")
    metadata: dict[str, Any] = {}
    for key in ("model", "dtype", "attention"):
        values = {setup.get(key) for setup in setups}
        if all(setups) and len(values) == 1:  # only what every run's config says alike
            metadata[key] = values.pop()
    metadata.update(runs=[str(Path(r)) for r in run_dirs], command=command or "")
    profile = fit_profile(steps, source=f"in {len(run_dirs)} run(s)", metadata=metadata)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(yaml.safe_dump(profile, sort_keys=False), encoding="utf-8")
    return profile


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.harness.sim.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", help="directories of real runs (with steps.jsonl)")
    parser.add_argument("--out", required=True, help="profile YAML to write")
    args = parser.parse_args(argv)
    command = "python -m nanovllm.harness.sim.calibrate " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        profile = calibrate(args.run_dirs, args.out, command)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    fit = profile["fit"]
    print(f"{profile['num_steps']} steps: R^2 {fit['r2']:.3f}, median |error| {fit['median_abs_rel_error']:.1%}, "
          f"p90 {fit['p90_abs_rel_error']:.1%}; wrote {args.out}")


if __name__ == "__main__":
    main()
