"""Fit the ``calibrated`` step-time model from real runs' ``steps.jsonl``::

    python -m nanovllm.harness.sim.calibrate RUN_DIR [RUN_DIR ...] --out profile.yaml
    python -m nanovllm.harness.sim.calibrate --this-machine [--dtype bfloat16] [--threads 1] [--full]
                                             [--quantization int8|gguf] [--kv-cache-dtype int8|fp8_e4m3]

The second form makes the runs too: the calibration workloads of the shipped profiles, run here (one round of
them by default, 2 runs: 4-8 minutes on one core of a loaded 2-core Xeon; ``--full``: the study's five
rounds), fitted into this machine's profile cache, which ``runner=sim`` then uses instead of the shipped
profile (``nanovllm.harness.sim.this_machine``); with ``--quantization`` / ``--kv-cache-dtype`` the runs use
those weights and that KV cache, and the profile is the one simulated runs with the same settings take. Every
profile records the machine its runs were measured on (``machine``: CPU model, architecture, ISA level, torch
threads, copy bandwidth), from the runs' ``metrics.json``
(runs that record none: what the ``--out`` profile says if it was fitted on the same runs, else the calibrating
process's), and ``runner=sim`` warns in one logged line when that is not this machine.

Non-negative least squares (``scipy.optimize.nnls``) of each step's duration on a per-step intercept and the
features the engine records (``CALIBRATION_FEATURES``), so every feature can only add time. The profile keeps
the coefficients, the range of every feature seen, the fit's error, the command that made it and the runs'
model, ``dtype`` and attention backend (the simulator refuses a profile of another dtype than the run's).

Two terms beyond the recorded features make the profile follow the real engine's pace:

- ``gemv_max_rows``: for runs on CPU, where the linear layers switch matmul kernels by row count, the fit adds
  ``KERNEL_FEATURES`` so each kernel gets its own cost (``--gemv-max-rows``; 0 fits without them). In bfloat16 on
  AVX-512 BF16 without AMX the switch is the engine's own (GEMV up to ``PackedLinear.GEMV_MAX_ROWS`` rows,
  oneDNN's GEMM above); elsewhere (float32; bf16 on AMX) one kernel takes every row count and picks its own
  blocking (oneDNN's decode steps were not monotonic in the batch size: 3 rows measured slower than 4), so the
  switch is found from the steps (``fitted_kernel_switch``: the row count that explains them best, kept only if the Bayesian
  information criterion says the two extra terms pay for themselves);
- ``step_gap``: the mean time between one step's end and the next one's start while the engine still had work
  (the serving loop's bookkeeping: records, loggers, arrivals), which ``steps.jsonl`` shows and no step's
  ``duration`` contains.

Runs with KV tiers (``kv_offload``) time each step's moves between the pool and every tier (``load_seconds``,
``write_seconds`` per tier in the step record): the terms above are fitted to each step's duration less those
moves, and the moves give each tier's link (``kv_tier_links``: ``fit_tier_links``), which the simulator prices
tier moves on when no ``hardware`` names links of its own.

Runs kept as an archive (``runs_archive``): with ``--runs-archive FILE`` (by default the archive the ``--out``
profile already records), RUN_DIRs missing on disk are unpacked from it first (``runs_archive.ensure_extracted``,
checked against the recorded SHA-256), and the new profile records the archive's file name and SHA-256, so a
shipped profile's own ``command`` reproduces it from a fresh clone.

A calibration the simulator could not trust stops with one ``error:`` line naming the cause: fewer than
``MIN_STEPS`` steps, or a feature that never varies across the steps (nothing to fit it from: e.g. runs with
no prefill at all).
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import yaml
from scipy.optimize import nnls

from nanovllm.harness.sim import runs_archive as archives
from nanovllm.harness.sim import this_machine
from nanovllm.serving.records import read_config, read_run
from nanovllm.harness.sim.speculation import SPEC_COST_FEATURES, run_method, spec_features, verify_features
from nanovllm.harness.sim.step_time import (
    CALIBRATION_FEATURES,
    KERNEL_FEATURES,
    KNEE_FEATURE,
    rows_above_knee,
    with_kernel_features,
    working_steps,
)
from nanovllm.models.fast_path import PackedLinear, linear_kernel

MIN_STEPS = 30
MIN_LINK_STEPS = 8   # steps that moved blocks through a tier, for its link's latency to be fitted apart
# Row counts tried for a switch found from the steps (a decode batch of up to this many sequences).
KERNEL_SWITCH_CANDIDATES = range(1, 9)
# Row counts tried for a bend (``--knee-rows fit``): where a step's rows stop riding free on the weights' read.
KNEE_CANDIDATES = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def fit_profile(steps: Sequence[dict[str, Any]], *, source: str = "", metadata: dict | None = None,
                gemv_max_rows: int | None = None, gaps: Sequence[float] = (),
                speculation: str | None = None, knee_rows: int | None = None) -> dict:
    """The profile (a plain dict, as written to YAML) fitted on ``steps``; ``ValueError`` naming the problem.
    ``gemv_max_rows``: also fit ``KERNEL_FEATURES`` with that switch (None: not); ``gaps``: the seconds between
    back-to-back steps (``step_gaps``), whose mean becomes ``step_gap``. ``speculation``: the proposer of runs
    with speculative decoding: each step is fitted on ``speculation.verify_features`` (proposals as prompt-like
    rows) plus ``SPEC_COST_FEATURES`` (the proposer's own work), whose coefficients go to the profile's
    ``speculation`` section. ``knee_rows``: also fit ``rows_above_knee`` bent at that many rows (the step's
    rows, proposals to verify included, past it), recorded as the profile's ``knee_rows``."""
    if len(steps) < MIN_STEPS:
        raise ValueError(f"calibration needs at least {MIN_STEPS} steps, got {len(steps)} {source}".rstrip())
    # Each step's own work, without the KV tiers' moves inside it: the simulator adds those on its links.
    durations = np.array([compute_seconds(s) for s in steps])
    links = fit_tier_links(steps)
    if speculation is not None:
        steps = [{**verify_features(spec_features(s)), **{f: spec_features(s)[f] for f in SPEC_COST_FEATURES}}
                 for s in steps]
    names = (CALIBRATION_FEATURES + (KERNEL_FEATURES if gemv_max_rows is not None else ())
             + ((KNEE_FEATURE,) if knee_rows else ()) + (SPEC_COST_FEATURES if speculation is not None else ()))
    rows = [with_kernel_features(s, gemv_max_rows) for s in steps]
    if knee_rows:
        rows = [{**s, KNEE_FEATURE: rows_above_knee(s, knee_rows)} for s in rows]
    features = np.array([[float(s[f]) for f in names] for s in rows])
    for j, name in enumerate(CALIBRATION_FEATURES):
        if np.ptp(features[:, j]) == 0:
            raise ValueError(f"calibration: feature {name} is {features[0, j]:g} in every step, so its cost "
                             "cannot be fitted; record runs whose steps vary it (e.g. prefill and decode steps)")
    # A kernel feature that never varies (runs whose steps all took one kernel) only duplicates the intercept.
    varying = [j for j, name in enumerate(names) if name in CALIBRATION_FEATURES or np.ptp(features[:, j]) > 0]
    design = np.hstack([np.ones((len(steps), 1)), features])
    columns = [0] + [j + 1 for j in varying]
    # Scale columns to comparable size so the solver's tolerance treats every feature alike.
    scale = np.abs(design[:, columns]).max(axis=0)
    solution, _ = nnls(design[:, columns] / scale, durations)
    coefficients = np.zeros(design.shape[1])
    coefficients[columns] = solution / scale
    predicted = design @ coefficients
    relative = np.abs(predicted - durations) / np.maximum(durations, 1e-9)
    residual = float(np.sum((durations - predicted) ** 2))
    total = float(np.sum((durations - durations.mean()) ** 2)) or 1.0
    kernel_split = {} if gemv_max_rows is None else {"gemv_max_rows": int(gemv_max_rows)}
    fitted = {name: float(c) for name, c in zip(names, coefficients[1:])}
    spec_section = {} if speculation is None else {"speculation": {
        "method": speculation, "coefficients": {name: fitted.pop(name) for name in SPEC_COST_FEATURES}}}
    return {
        "step_time": "calibrated",
        **(metadata or {}),
        "num_steps": len(steps),
        **kernel_split,
        **({"knee_rows": int(knee_rows)} if knee_rows else {}),
        "step_gap": float(np.mean(gaps)) if len(gaps) else 0.0,
        "intercept": float(coefficients[0]),
        "coefficients": fitted,
        **spec_section,
        **({"kv_tier_links": links} if links else {}),
        "feature_range": {name: [float(features[:, j].min()), float(features[:, j].max())]
                          for j, name in enumerate(names)},
        "fit": {"r2": 1.0 - residual / total, "median_abs_rel_error": float(np.median(relative)),
                "p90_abs_rel_error": float(np.quantile(relative, 0.9))},
    }


# Engine settings that change step times, recorded in a profile when its runs did not use the default (the
# simulator warns when a run's differ: CalibratedStepTime.setting_warnings).
RECORDED_SETTINGS = {"kv_cache_dtype": "auto", "quantization": "none"}


def run_setup(run_dir: str | Path) -> dict[str, Any]:
    """What a profile depends on besides the batch, from the run's ``config.json``: the model (None: the
    default one), ``dtype``, attention backend, ``kv_cache_dtype`` and ``quantization``; {} for a run without a
    config (written from Python)."""
    config = read_config(run_dir) or {}
    if not config:
        return {}
    engine = config.get("engine") or {}
    return {"model": (config.get("model") or {}).get("path"), "dtype": engine.get("dtype"),
            "attention": (config.get("attention") or {}).get("name"), "device": engine.get("device", "cpu"),
            "kv_cache_dtype": engine.get("kv_cache_dtype", "auto"), "quantization": engine.get("quantization")}


def tier_move_seconds(step: Mapping[str, Any]) -> float:
    """Seconds the step spent moving blocks between the pool and the KV tiers (every tier's ``load_seconds``
    and ``write_seconds`` in it; 0 without tiers)."""
    return sum(float(counts.get("load_seconds", 0.0)) + float(counts.get("write_seconds", 0.0))
               for counts in (step.get("kv_tiers") or {}).values())


def compute_seconds(step: Mapping[str, Any]) -> float:
    """The step's duration less its tier moves: what the step-time model's terms are fitted to."""
    return float(step["duration"]) - tier_move_seconds(step)


def fit_tier_links(steps: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per KV tier the steps moved blocks through, the link the simulator prices its moves on
    (``hardware.kv_tier_links``' form, ``nanovllm.engine.sim_runner``: ``latency + bytes / bandwidth`` a step):
    non-negative least squares of each step's measured seconds for that tier (``load_seconds + write_seconds``)
    on the bytes it moved (loaded plus written) and a constant, over the steps that moved any. With fewer than
    ``MIN_LINK_STEPS`` such steps, all moving the same bytes, or a fit that finds no per-byte cost, the link is
    the tier's bytes over its seconds with no latency. Tiers whose moves took no measured time (payload-free
    simulated runs) get none."""
    moves: dict[str, list[tuple[float, float]]] = {}
    for step in steps:
        for name, counts in (step.get("kv_tiers") or {}).items():
            moved = float(counts.get("bytes_loaded", 0)) + float(counts.get("bytes_written", 0))
            seconds = float(counts.get("load_seconds", 0.0)) + float(counts.get("write_seconds", 0.0))
            if moved > 0 and seconds > 0:
                moves.setdefault(name, []).append((moved, seconds))
    links = {}
    for name, rows in sorted(moves.items()):
        moved, seconds = np.array(rows).T
        link = {"bandwidth": float(moved.sum() / seconds.sum()), "latency": 0.0}
        if len(rows) >= MIN_LINK_STEPS and np.ptp(moved) > 0:
            scale = moved.max()
            (latency, per_byte), _ = nnls(np.column_stack([np.ones(len(rows)), moved / scale]), seconds)
            if per_byte > 0:
                link = {"bandwidth": float(scale / per_byte), "latency": float(latency)}
        links[name] = link
    return links


def step_gaps(steps: Sequence[dict[str, Any]]) -> list[float]:
    """Seconds from each step's end to the next step's start, for the steps after which the engine still had
    requests (so the loop went straight on, not idle until an arrival); none for steps without start times.
    A cluster's steps (they carry ``replica``) interleave replicas: each replica's gaps are between its own
    steps."""
    by_replica: dict[Any, list[dict[str, Any]]] = {}
    for step in steps:
        by_replica.setdefault(step.get("replica"), []).append(step)
    gaps = []
    for own in by_replica.values():
        for step, following in itertools.pairwise(own):
            if "start_time" in step and "start_time" in following and step["num_running"] + step["num_waiting"] > 0:
                gaps.append(max(0.0, following["start_time"] - step["start_time"] - step["duration"]))
    return gaps


def default_gemv_max_rows(setups: Sequence[dict[str, Any]],
                          machines: Sequence[dict[str, Any] | None] = ()) -> int | str | None:
    """The engine's 2-row GEMV/GEMM switch (``PackedLinear.GEMV_MAX_ROWS``) when every run was in bfloat16 on
    CPU and none on a level where bf16 linears run brgemm (AMX: ``fast_path.linear_kernel``; a run whose
    ``machines`` entry names no ISA counts as not); "fit" (find it from the steps: ``fitted_kernel_switch``) for
    other runs on CPU (float32, bf16 on AMX, where brgemm has no switch of its own, or quantized weights, whose
    int8 kernels block rows their own way); None off the CPU. Below
    AVX-512 BF16 the engine has no GEMV, but oneDNN changes kernels at a few rows too, and the shipped bf16
    profiles were fit there with the fixed switch: they stay reproducible from their archives."""
    import torch

    if not setups or not all(setup.get("device", "cpu") == "cpu" for setup in setups):
        return None
    if any(setup.get("quantization") for setup in setups):
        return "fit"  # quantized linears: the int8 kernels' own blocking, not the bf16 GEMV switch
    isas = [(info or {}).get("isa") for info in machines] or [None]
    if all(setup.get("dtype") == "bfloat16" for setup in setups) and \
            not any(isa is not None and linear_kernel(torch.bfloat16, isa) == "brgemm" for isa in isas):
        return PackedLinear.GEMV_MAX_ROWS
    return "fit"


def _bic_choice(steps: Sequence[dict[str, Any]], candidates: Sequence[int], parameters: int,
                term: Callable[[int | None], dict[str, Any]]) -> int | None:
    """The candidate whose fit (``fit_profile`` of ``steps`` with ``term(candidate)`` as its extra arguments)
    leaves the least squared error, or None when even that one does not beat the fit without it
    (``term(None)``) by the Bayesian information criterion, ``n ln(RSS) + k ln(n)``, the term costing
    ``parameters``; None too when there is no candidate or the fit without it is already exact."""
    n = len(steps)
    durations = np.array([compute_seconds(s) for s in steps])
    total = float(np.sum((durations - durations.mean()) ** 2))

    def squared_error(candidate: int | None) -> float:
        return max((1.0 - fit_profile(steps, **term(candidate))["fit"]["r2"]) * total, 1e-300)

    without = squared_error(None)
    if not candidates or without <= 1e-12 * total:  # already exact: nothing left for the term to explain
        return None
    errors = {candidate: squared_error(candidate) for candidate in candidates}
    best = min(errors, key=errors.__getitem__)
    return best if n * np.log(errors[best] / without) + parameters * np.log(n) < 0 else None


def fitted_kernel_switch(steps: Sequence[dict[str, Any]], gaps: Sequence[float] = (),
                         speculation: str | None = None) -> int | None:
    """The row count up to which the steps' matmuls look like one kernel and above it another: the candidate
    (``KERNEL_SWITCH_CANDIDATES``) whose fit leaves the least squared error, or None when even that one does not
    beat the fit without a switch by the Bayesian information criterion (the switch costs three parameters, its
    row count and the two kernel terms), so steps without a switch get none."""
    return _bic_choice(steps, KERNEL_SWITCH_CANDIDATES, 3,
                       lambda rows: dict(gemv_max_rows=rows, gaps=gaps, speculation=speculation))


def fitted_knee(steps: Sequence[dict[str, Any]], gaps: Sequence[float] = (), speculation: str | None = None,
                gemv_max_rows: int | None = None) -> int | None:
    """The bend (``KNEE_CANDIDATES`` within the steps' row counts) whose fit leaves the least squared error, or
    None when it does not beat the fit without one by the Bayesian information criterion (two parameters: the
    row count and its coefficient)."""
    spec = [verify_features(spec_features(s)) for s in steps] if speculation is not None else steps
    most = max(s["num_prefill_tokens"] + s["num_decode_seqs"] for s in spec)
    return _bic_choice(steps, [k for k in KNEE_CANDIDATES if k < most], 2,
                       lambda knee: dict(gemv_max_rows=gemv_max_rows, gaps=gaps, speculation=speculation,
                                         knee_rows=knee))


def calibrate(run_dirs: Sequence[str | Path], out: str | Path, command: str | None = None,
              gemv_max_rows: int | None | str = "auto", runs_archive: dict[str, str] | None = None,
              knee_rows: int | None | str = None) -> dict:
    """Fit on every step of ``run_dirs`` and write the profile to ``out``; returns it. The profile records
    the runs' model, dtype and attention backend (``run_setup``) and machine (``this_machine.profile_machine``);
    runs in different dtypes or on different machines are an error (one profile describes one dtype's step
    times on one machine). ``gemv_max_rows``: the kernel split to fit ("auto":
    ``default_gemv_max_rows``; "fit": ``fitted_kernel_switch``; None or 0: none). ``runs_archive``: the
    ``{"file", "sha256"}`` of the archive the runs came from, recorded after ``command``. ``knee_rows``: a bend
    in the step cost (``rows_above_knee``): a row count, "fit" (``fitted_knee``) or None/0 for none."""
    steps: list[dict] = []
    gaps: list[float] = []
    configs = []
    setups = []
    machines = []
    for run_dir in run_dirs:
        data = read_run(run_dir, missing_ok=False)
        steps.extend(working_steps(data.steps))
        gaps.extend(step_gaps(data.steps))
        configs.append(data.metrics.get("simulated", False))
        setups.append(run_setup(run_dir))
        machines.append(data.metrics.get("machine"))
    if any(configs):
        raise ValueError("calibration: a run directory holds a simulated run; calibrate from real runs only")
    dtypes = sorted({str(setup["dtype"]) for setup in setups if setup.get("dtype")})
    if len(dtypes) > 1:
        raise ValueError(f"calibration: the runs use different engine.dtype ({', '.join(dtypes)}); a profile "
                         "describes one dtype, so calibrate each from its own runs")
    metadata: dict[str, Any] = {}
    recorded = {}
    for key, default in RECORDED_SETTINGS.items():
        values = sorted({str(setup.get(key) or default) for setup in setups if setup})
        if len(values) > 1:
            raise ValueError(f"calibration: the runs use different engine.{key} ({', '.join(values)}); a profile "
                             f"describes one {key}'s step times, so calibrate each from its own runs")
        if values and values[0] != default:  # a profile of an 8-bit cache or quantized weights says so
            recorded[key] = values[0]
    for key in ("model", "dtype", "attention"):
        values = {setup.get(key) for setup in setups}
        if all(setups) and len(values) == 1:  # only what every run's config says alike
            metadata[key] = values.pop()
    metadata.update(recorded)
    runs = [str(Path(r)) for r in run_dirs]
    metadata["machine"] = this_machine.profile_machine(machines, previous=_previous_machine(out, runs))
    metadata.update(runs=runs, command=command or "")
    if runs_archive:
        metadata[archives.KEY] = {"file": runs_archive["file"], "sha256": runs_archive["sha256"]}
    methods = sorted({str(run_method(run_dir)) for run_dir in run_dirs})
    if len(methods) > 1:
        raise ValueError(f"calibration: the runs use different speculative proposers ({', '.join(methods)}); a "
                         "profile prices one, so calibrate each from its own runs")
    speculation = None if methods == ["None"] else methods[0]
    if gemv_max_rows == "auto":
        gemv_max_rows = default_gemv_max_rows(setups, machines)
    if gemv_max_rows == "fit":
        gemv_max_rows = fitted_kernel_switch(steps, gaps, speculation)
        metadata["kernel_switch"] = "fitted from the steps" if gemv_max_rows else "none (BIC)"
    switch = int(gemv_max_rows) if gemv_max_rows else None
    if knee_rows == "fit":
        knee_rows = fitted_knee(steps, gaps, speculation, switch)
        metadata["knee"] = "fitted from the steps" if knee_rows else "none (BIC)"
    profile = fit_profile(steps, source=f"in {len(run_dirs)} run(s)", metadata=metadata,
                          gemv_max_rows=switch, gaps=gaps, speculation=speculation,
                          knee_rows=int(knee_rows) if knee_rows else None)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(yaml.safe_dump(profile, sort_keys=False), encoding="utf-8")
    return profile


def _previous_machine(out: str | Path, runs: list[str]) -> dict | None:
    """The ``machine`` the profile at ``out`` records, when it was fitted on these very ``runs``: refitting the
    runs of a shipped profile (runs that record no machine) keeps the machine they were measured on."""
    try:
        previous = yaml.safe_load(Path(out).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    if isinstance(previous, dict) and previous.get("runs") == runs and isinstance(previous.get("machine"), dict):
        return previous["machine"]
    return None


def _runs_archive(run_dirs: Sequence[str], out: str, given: str | None) -> dict[str, str] | None:
    """The archive the runs come from (``--runs-archive``, else the one the existing ``out`` profile records),
    unpacked first when a run directory is missing; None when there is none to use."""
    expected = None
    if given is None:
        recorded = archives.runs_archive(out) if Path(out).is_file() else None
        if recorded is None or not Path(recorded["file"]).is_file():
            return None  # nothing recorded, or its archive is not here: the runs are read as given
        given, expected = recorded["file"], recorded["sha256"]
    if any(not Path(d).is_dir() for d in run_dirs):
        archives.ensure_extracted(given, sha256=expected)
    digest = archives.file_sha256(given)
    if expected is not None and digest != expected:
        raise ValueError(f"run archive {given} has SHA-256 {digest}, but {out} records {expected}")
    return {"file": given, "sha256": digest}


def calibrate_this_machine(dtype: str = "bfloat16", threads: int = 1, rounds: int = this_machine.SHORT_ROUNDS,
                           out: str | Path | None = None, echo: bool = True, quantization: str | None = None,
                           kv_cache_dtype: str = "auto") -> tuple[dict, Path]:
    """Make the real runs of rounds 1..``rounds`` of the calibration workloads here (``threads`` torch threads,
    ``dtype``, weights ``quantization``, KV cache ``kv_cache_dtype``), fit a profile on them and write it to
    ``out`` (None: this machine's cache entry for those settings, the one ``runner=sim`` picks up for runs
    with them). The runs go beside the profile (``runs-<dtype>[-<quantization>][-kv-<kv dtype>]/``), replacing
    earlier ones. Returns the profile and where it went."""
    if dtype not in this_machine.DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(this_machine.DTYPES)}, got {dtype!r}")
    if threads < 1 or rounds < 1:
        raise ValueError(f"--threads and --rounds must be at least 1, got {threads} and {rounds}")
    settings = this_machine.settings_overrides(quantization, kv_cache_dtype)
    here = this_machine.this_machine(threads=threads)
    default_out = this_machine.cached_profile_path(dtype, here, quantization, kv_cache_dtype)
    out = Path(out) if out is not None else default_out
    runs_root = out.parent / f"runs-{dtype}{this_machine.settings_suffix(quantization, kv_cache_dtype)}"
    shutil.rmtree(runs_root, ignore_errors=True)
    run_dirs = []
    start = time.perf_counter()
    for name, overrides in this_machine.calibration_runs(rounds):
        run_dirs.append(runs_root / name)
        this_machine.run_engine([*overrides, *settings], run_dirs[-1], dtype, threads, echo=echo)
    command = (f"{this_machine.calibrate_command(dtype, threads, quantization, kv_cache_dtype)} --rounds {rounds}"
               + (f" --out {out}" if out != default_out else ""))
    profile = calibrate(run_dirs, out, command=command)
    if profile["machine"].get("threads") != threads:
        raise RuntimeError(f"calibration runs recorded {profile['machine'].get('threads')} torch threads, not the "
                           f"{threads} asked for (OMP_NUM_THREADS={threads} did not take effect)")
    if echo:
        print(f"calibration runs took {time.perf_counter() - start:.0f} s", flush=True)
    return profile, out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.harness.sim.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="*", help="directories of real runs (with steps.jsonl)")
    parser.add_argument("--out", default=None, help="profile YAML to write (--this-machine: default this "
                        "machine's cache entry, which runner=sim picks up)")
    parser.add_argument("--gemv-max-rows", type=int, default=None,
                        help="fit the matmul kernel split at this many rows (0: none; default: the engine's GEMV "
                             "switch when the runs are bfloat16 on CPU, found from the steps for other CPU runs)")
    parser.add_argument("--knee-rows", default=None,
                        help="fit a bend in the step cost at this many rows (prefill tokens + decodes + proposals; "
                             "'fit': the row count the steps favour by BIC, if any; default: none)")
    parser.add_argument("--runs-archive", default=None,
                        help="a .tar.xz the runs are kept in: RUN_DIRs missing on disk are unpacked from it, and the "
                             "profile records its name and SHA-256 (default: the archive the --out profile records)")
    here = parser.add_argument_group("--this-machine: make the calibration runs here, then fit them")
    here.add_argument("--this-machine", action="store_true",
                      help="run the calibration workloads on this machine and write its profile")
    here.add_argument("--dtype", choices=this_machine.DTYPES, default="bfloat16", help="engine.dtype of the runs")
    here.add_argument("--threads", type=int, default=1,
                      help="torch threads of the runs (default 1, as the shipped profiles; runner=sim uses a "
                           "cached profile whose thread count is its own torch thread count)")
    here.add_argument("--rounds", type=int, default=None,
                      help=f"rounds of the calibration workloads, 2 runs each (default {this_machine.SHORT_ROUNDS})")
    here.add_argument("--full", action="store_true",
                      help=f"the study's protocol: {this_machine.FULL_ROUNDS} rounds (10 runs)")
    here.add_argument("--quantization", default=None,
                      help=f"engine.quantization of the runs ({', '.join(this_machine.QUANTIZATIONS)}; default dense)")
    here.add_argument("--kv-cache-dtype", default="auto",
                      help=f"engine.kv_cache_dtype of the runs ({', '.join(this_machine.KV_CACHE_DTYPES)})")
    args = parser.parse_args(argv)
    command = "python -m nanovllm.harness.sim.calibrate " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.gemv_max_rows is not None and args.gemv_max_rows < 0:
        _fail(f"--gemv-max-rows must be >= 0, got {args.gemv_max_rows}")
    knee: int | str | None = args.knee_rows
    if knee is not None and knee != "fit":
        if not str(knee).isdigit():
            _fail(f"--knee-rows must be a row count >= 0 or 'fit', got {knee!r}")
        knee = int(knee)
    try:
        if args.this_machine:
            if args.run_dirs:
                _fail("--this-machine makes its own runs; give it no RUN_DIRs")
            if args.full and args.rounds is not None:
                _fail("give --full or --rounds, not both")
            rounds = this_machine.FULL_ROUNDS if args.full else args.rounds or this_machine.SHORT_ROUNDS
            profile, out = calibrate_this_machine(args.dtype, args.threads, rounds, args.out,
                                                               quantization=args.quantization,
                                                               kv_cache_dtype=args.kv_cache_dtype)
        else:
            if not args.run_dirs or args.out is None:
                _fail("give RUN_DIR... and --out PROFILE, or --this-machine")
            out = args.out
            archive = _runs_archive(args.run_dirs, out, args.runs_archive)
            profile = calibrate(args.run_dirs, out, command,
                                "auto" if args.gemv_max_rows is None else args.gemv_max_rows, runs_archive=archive,
                                knee_rows=knee)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        _fail(str(exc))
    except subprocess.CalledProcessError as exc:
        _fail(f"a calibration run failed (exit status {exc.returncode}): {shlex.join(exc.cmd)}")
    fit = profile["fit"]
    print(f"{profile['num_steps']} steps: R^2 {fit['r2']:.3f}, median |error| {fit['median_abs_rel_error']:.1%}, "
          f"p90 {fit['p90_abs_rel_error']:.1%}; machine: {this_machine.describe_machine(profile['machine'])}; "
          f"wrote {out}")


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
    main()
