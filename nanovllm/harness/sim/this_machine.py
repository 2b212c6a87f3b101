"""Step-time profiles per machine: which machine a profile was measured on, whether that is this one, and a
profile of this machine's own, calibrated with one command and cached::

    python -m nanovllm.harness.sim.calibrate --this-machine [--dtype bfloat16] [--threads 1] [--full]
                                             [--quantization int8|gguf] [--kv-cache-dtype int8|fp8_e4m3]

A step time is a property of the CPU it was measured on (its model, the instruction set the kernels use, the
torch threads), so ``calibrate`` writes that into every profile (``machine:``) and ``runner=sim`` compares it
with this machine (``mismatch``): a profile of another CPU model, ISA level or thread count gets one warning
line (logged: a run prints it and writes it to its ``run.log``) naming both machines and the command above.

That command makes real runs of the calibration workloads (the ones ``experiments/sim_accuracy.py`` fits the
shipped profiles on, ``CALIBRATION_WORKLOADS``; by default ``SHORT_ROUNDS`` round of them, ``--full`` the
study's ``FULL_ROUNDS``) and writes the profile into the per-machine cache (``profiles_dir()``:
``$NANOVLLM_SIM_PROFILES``, default ``$NANOVLLM_CACHE/sim-profiles``, i.e. ``~/.cache/nanovllm/sim-profiles``),
one directory per CPU model, ISA level and thread count (``machine_key``), one file per dtype and engine
setting that changes step times (quantized weights, an 8-bit KV cache: ``profile_name``), with the runs beside
it. ``runner=sim`` without ``runner.profile`` then uses that profile instead of the shipped one
(``cached_profile``), as long as its own torch thread count is the profile's; a quantized or 8-bit-KV run
without a profile of its own settings takes the dense one, and its warning names the command that calibrates
its settings.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from nanovllm import machine
from nanovllm.config import KV_CACHE_DTYPES, QUANTIZATIONS  # what a profile can be calibrated for (re-exported)
from nanovllm.paths import SIM_PROFILES_ENV, sim_profiles_dir

PROFILES_ENV = SIM_PROFILES_ENV
# What a profile records of its machine (``machine.describe`` has these and the ISA levels supported).
MACHINE_KEYS = ("cpu", "arch", "isa", "threads", "copy_bandwidth_gbs")
# What has to agree for a profile to describe this machine.
MATCH_KEYS = ("cpu", "isa", "threads")

# The calibration workloads of the shipped profiles (``experiments/sim_accuracy.py measure``): round k serves
# each with workload seed k (never 0, the seed of the study's compared runs).
CALIBRATION_WORKLOADS: dict[str, list[str]] = {
    "calib_synthetic": ["workload=synthetic", "workload.num_requests=40", "workload.request_rate=3",
                        "workload.input_len.kind=uniform", "workload.input_len.mean=200",
                        "workload.input_len.range_ratio=0.9", "workload.output_len.kind=uniform",
                        "workload.output_len.mean=32", "workload.output_len.range_ratio=0.8"],
    "calib_chat": ["workload=chat", "workload.num_requests=24", "workload.request_rate=2", "workload.max_tokens=64"],
}
# Engine settings of every calibration (and study) run.
RUN_OVERRIDES = ["engine.max_num_seqs=8", "progress=false", "monitor.calibrate=false"]
SHORT_ROUNDS = 1  # --this-machine: one round, 2 runs (a short calibration, against the study's 10 runs)
FULL_ROUNDS = 5   # --full: the study's protocol, 10 runs
DTYPES = ("bfloat16", "float32")  # the dtypes a profile is shipped in


def settings_overrides(quantization: str | None = None, kv_cache_dtype: str = "auto") -> list[str]:
    """The engine overrides of runs with quantized weights and/or an 8-bit KV cache (none for the defaults);
    ``ValueError`` naming the flag for a value the engine does not take."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return ([f"engine.quantization={quantization}"] if quantization else []) + \
        ([f"engine.kv_cache_dtype={kv_cache_dtype}"] if kv_cache_dtype != "auto" else [])


def thread_env(threads: int) -> dict[str, str]:
    """The environment that gives a run ``threads`` torch (OpenMP) threads."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def run_engine(overrides: Sequence[str], run_dir: Path, dtype: str, threads: int = 1, cwd: Path | None = None,
               echo: bool = True) -> None:
    """One real run, ``python -m nanovllm.run`` with ``RUN_OVERRIDES`` + ``overrides`` in ``dtype``, into
    ``run_dir``, with ``threads`` torch threads (its stdout dropped; errors stop with CalledProcessError). The
    caller's ``overrides`` come after ``RUN_OVERRIDES``, so they win (``engine.max_num_seqs``)."""
    command = [sys.executable, "-m", "nanovllm.run", *RUN_OVERRIDES, *overrides, f"engine.dtype={dtype}",
               f"hydra.run.dir={run_dir}"]
    if echo:
        print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, cwd=cwd, stdout=subprocess.DEVNULL, env={**os.environ, **thread_env(threads)})


def calibration_runs(rounds: int) -> list[tuple[str, list[str]]]:
    """(run name, overrides) of rounds 1..``rounds`` of the calibration workloads."""
    return [(f"{name}_seed{seed}", [*overrides, f"workload.seed={seed}"])
            for seed in range(1, rounds + 1) for name, overrides in CALIBRATION_WORKLOADS.items()]


# -- which machine ------------------------------------------------------------------------------------------------

def this_machine(threads: int | None = None, bandwidth: bool = False) -> dict[str, Any]:
    """This machine as a profile records it (``MACHINE_KEYS``); ``threads`` None: torch's current count."""
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    info = machine.describe(threads, bandwidth=bandwidth)
    return {key: info[key] for key in MACHINE_KEYS if key in info}


def machine_key(info: Mapping[str, Any]) -> str:
    """The cache directory of one machine's profiles: CPU model, ISA level and threads, as a file name
    (``intel-r-xeon-r-processor-2-80ghz_avx512_1t``)."""
    slug = re.sub(r"[^a-z0-9]+", "-", str(info["cpu"]).lower()).strip("-") or "cpu"
    return f"{slug}_{info['isa']}_{int(info['threads'])}t"


def profiles_dir() -> Path:
    """The per-machine profile cache: ``$NANOVLLM_SIM_PROFILES``, else ``<cache_root()>/sim-profiles``."""
    return sim_profiles_dir()


def profile_name(dtype: str, quantization: str | None = None, kv_cache_dtype: str = "auto") -> str:
    """The file name of a profile of the default model (SmolLM2-135M) in ``dtype``, shipped or cached:
    ``smollm2-135m-bfloat16-cpu.yaml``, and for runs with quantized weights and/or an 8-bit KV cache
    ``smollm2-135m-bfloat16-int8-kv-int8-cpu.yaml`` (only dense profiles are shipped)."""
    return f"smollm2-135m-{dtype}{settings_suffix(quantization, kv_cache_dtype)}-cpu.yaml"


def settings_suffix(quantization: str | None = None, kv_cache_dtype: str = "auto") -> str:
    """What a profile's and its runs' names add for quantized weights and/or an 8-bit KV cache: ``-int8``,
    ``-kv-int8``, ``-int8-kv-int8``; nothing for the defaults."""
    return (f"-{quantization}" if quantization else "") + (f"-kv-{kv_cache_dtype}" if kv_cache_dtype != "auto" else "")


def cached_profile_path(dtype: str, info: Mapping[str, Any] | None = None, quantization: str | None = None,
                        kv_cache_dtype: str = "auto") -> Path:
    """Where this machine's (or ``info``'s) profile in ``dtype`` (with those weights and KV cache) is cached,
    whether or not it exists."""
    return profiles_dir() / machine_key(info or this_machine()) / profile_name(dtype, quantization, kv_cache_dtype)


def cached_profile(dtype: str, quantization: str | None = None, kv_cache_dtype: str = "auto") -> Path | None:
    """This machine's cached profile of the default model in ``dtype`` (at the current torch thread count) for
    runs with ``quantization`` and ``kv_cache_dtype``, or None when none was calibrated."""
    path = cached_profile_path(dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    return path if path.is_file() else None


def cached_thread_counts(dtype: str) -> list[int]:
    """The thread counts this CPU and ISA level has a cached ``dtype`` profile for."""
    info = this_machine(threads=1)
    prefix = machine_key(info)[: -len("1t")]
    root = profiles_dir()
    if not root.is_dir():
        return []
    counts = []
    for entry in root.iterdir():
        tail = entry.name[len(prefix):]
        if entry.name.startswith(prefix) and tail[:-1].isdigit() and (entry / profile_name(dtype)).is_file():
            counts.append(int(tail[:-1]))
    return sorted(counts)


@functools.cache
def copy_bandwidth_gbs() -> float:
    """This machine's copy bandwidth (``machine.copy_bandwidth_gbs``, one decimal), measured once a process."""
    return round(machine.copy_bandwidth_gbs(), 1)


def profile_machine(recorded: Sequence[Mapping[str, Any] | None],
                    previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a profile fitted on runs that recorded ``recorded`` (each run's ``metrics.json`` ``machine``, None
    where a run has none) says under ``machine``: the runs' CPU, ISA level and threads; when no run records any,
    ``previous`` (what an earlier profile of the very same runs said: a refit keeps it), else the calibrating
    process's. The copy bandwidth is ``previous``'s when it describes the same machine (a refit of the same runs
    gives the same profile), else measured here when the machine is this CPU and ISA level. ``source`` says
    which. Runs of different machines are a ``ValueError``."""
    known = [dict(info) for info in recorded if isinstance(info, Mapping)]
    if not known and previous is not None:
        return dict(previous)
    distinct = {tuple(str(info.get(key)) for key in ("arch", *MATCH_KEYS)) for info in known}
    if len(distinct) > 1:
        raise ValueError("calibration: the runs were measured on different machines ("
                         + "; ".join(sorted(", ".join(d) for d in distinct)) + "); a profile describes one machine "
                         "(CPU model, ISA level, threads), so calibrate each from its own runs")
    if known:
        info = {key: known[0][key] for key in MACHINE_KEYS if key in known[0]}
        info["source"] = "the runs' metrics.json"
    else:
        info = this_machine()
        info["source"] = "the calibrating process (the runs record no machine)"
    here = this_machine(threads=info.get("threads"))
    same_as_before = previous is not None and all(str(info.get(key)) == str(previous.get(key))
                                                  for key in MATCH_KEYS)
    if "copy_bandwidth_gbs" not in info and same_as_before and previous.get("copy_bandwidth_gbs") is not None:
        info["copy_bandwidth_gbs"] = previous["copy_bandwidth_gbs"]  # a refit of the same runs reproduces it
    if "copy_bandwidth_gbs" not in info:
        same = all(str(info.get(key)) == str(here.get(key)) for key in ("cpu", "isa"))
        info["copy_bandwidth_gbs"] = copy_bandwidth_gbs() if same else None
    return {**{key: info.get(key) for key in MACHINE_KEYS}, "source": info["source"]}


def describe_machine(info: Mapping[str, Any]) -> str:
    """``<cpu> (<isa>, <n> thread(s))``."""
    threads = info.get("threads")
    plural = "" if threads == 1 else "s"
    return f"{info.get('cpu', 'unknown CPU')} ({info.get('isa', 'unknown ISA')}, {threads} thread{plural})"


def calibrate_command(dtype: str, threads: int, quantization: str | None = None,
                      kv_cache_dtype: str = "auto") -> str:
    """The command that calibrates this machine in ``dtype`` with ``threads`` threads (``calibrate --this-machine``),
    for runs with ``quantization`` and ``kv_cache_dtype``."""
    return (f"python -m nanovllm.harness.sim.calibrate --this-machine --dtype {dtype} --threads {threads}"
            + (f" --quantization {quantization}" if quantization else "")
            + (f" --kv-cache-dtype {kv_cache_dtype}" if kv_cache_dtype != "auto" else ""))


def mismatch(profile: Mapping[str, Any], label: str, dtype: str,
             here: Mapping[str, Any] | None = None) -> str | None:
    """One line when ``profile`` (``label``: which file it is) records a machine other than this one (or
    ``here``): another CPU model, ISA level or thread count. None when it matches or records no machine."""
    recorded = profile.get("machine")
    if not isinstance(recorded, Mapping):
        return None
    here = here or this_machine()
    differ = [key for key in MATCH_KEYS if str(recorded.get(key)) != str(here.get(key))]
    if not differ:
        return None
    # This CPU calibrated at another thread count (a 1-thread profile, and a run with torch's default threads).
    others = [n for n in cached_thread_counts(dtype) if n != here["threads"]]
    hint = (f" (this CPU has a cached profile for {', '.join(map(str, others))} thread(s): "
            f"OMP_NUM_THREADS={others[0]} uses it)") if others else ""
    return (f"runner=sim: step-time profile {label} was measured on {describe_machine(recorded)}, not on "
            f"this machine, {describe_machine(here)}: its simulated times may be far off here; calibrate this "
            f"machine with `{calibrate_command(dtype, int(here['threads']))}` (a few minutes; runner=sim without "
            f"runner.profile then uses it){hint}")


# -- calibrate this machine ---------------------------------------------------------------------------------------
