"""What machine this is, for the kernels' dispatch, the simulator's profiles and the benchmarks' headers: the CPU
model, the instruction-set levels it supports, the level in force, threads, and a measured copy bandwidth.

nano-vllm's CPU code runs at one of five ISA levels, best first::

    amx          AMX tiles: the bf16 linears run on them (AMX-BF16) through oneDNN's brgemm micro-kernel
                 (nanovllm/csrc/brgemm_linear.cpp), the int8 linears (AMX-INT8) through nano-vllm's own
                 (nanovllm/csrc/int8_amx.cpp); nano-vllm's other kernels run their avx512_bf16 build
    avx512_bf16  AVX-512 with the bf16 dot-product instruction (vdpbf16ps) and VNNI (vpdpbusd): the bf16
                 attention and GEMV kernels, the int8 dot products of the quantized linears
    avx512       AVX-512F/BW/VL/DQ: the float32-accumulating vector kernels, bf16 converted in registers
    avx2         AVX2 + FMA: the kernels' portable loops, auto-vectorized; torch's AVX2 kernels
    scalar       the x86-64 (or other) baseline: the portable loops only

The level in force is the best one the CPU has, unless ``NANOVLLM_CPU_ISA`` names a lower one: then nano-vllm's
kernels are built for that level and torch is capped to it too (``ONEDNN_MAX_CPU_ISA`` for oneDNN's matmuls,
``ATEN_CPU_CAPABILITY`` for torch's own vector kernels), so a machine with AMX can run, and test, every lower
path. torch reads those two variables once, before its first matmul: ``import nanovllm`` sets them, so set
``NANOVLLM_CPU_ISA`` before the process starts (or before importing nanovllm). This module imports no torch.
"""

from __future__ import annotations

import functools
import os
import platform
import time

ISA_ENV = "NANOVLLM_CPU_ISA"
ISA_LEVELS = ("amx", "avx512_bf16", "avx512", "avx2", "scalar")  # best first

_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"})
# /proc/cpuinfo flags each level needs (each level also needs every flag of the levels below it).
REQUIRED_FLAGS: dict[str, frozenset[str]] = {
    "amx": _AVX512 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"},
    "avx512_bf16": _AVX512 | {"avx512_bf16", "avx512_vnni"},  # every such CPU has VNNI (the int8 dot product)
    "avx512": _AVX512,
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "scalar": frozenset(),
}
# The caps a forced level puts on torch: oneDNN's highest ISA, and ATen's vector-kernel capability.
ONEDNN_CAP = {"avx512_bf16": "AVX512_CORE_BF16", "avx512": "AVX512_CORE", "avx2": "AVX2", "scalar": "SSE41"}
ATEN_CAP = {"avx512_bf16": "avx512", "avx512": "avx512", "avx2": "avx2", "scalar": "default"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo spells them (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``Intel(R) Xeon(R) ...``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), "")
    except OSError:  # no /proc (not Linux): what the platform module knows
        name = ""
    return name or platform.processor() or platform.machine() or "unknown CPU"


def supported_isas(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The ISA levels this CPU (or one with ``flags``) can run, best first; always ends with ``scalar``.
    The SIMD levels are x86-64 ones: another architecture runs ``scalar``."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = cpu_flags() if flags is None else flags
    return tuple(level for level in ISA_LEVELS
                 if level == "scalar" or (x86 and REQUIRED_FLAGS[level] <= flags))


def native_isa() -> str:
    """The best level this CPU supports."""
    return supported_isas()[0]


def check_isa(level: str, source: str = ISA_ENV) -> str:
    """``level`` if it names a level this CPU runs; else ``ValueError`` naming ``source`` and the choices."""
    if level not in ISA_LEVELS:
        raise ValueError(f"{source}={level!r} is not an ISA level; choose one of {', '.join(ISA_LEVELS)}")
    supported = supported_isas()
    if level not in supported:
        raise ValueError(f"{source}={level!r}: this CPU ({cpu_model()}) does not support it; it runs "
                         f"{', '.join(supported)}")
    return level


def selected_isa() -> str:
    """The level in force: ``NANOVLLM_CPU_ISA`` when set (checked), else the CPU's best."""
    forced = os.environ.get(ISA_ENV, "").strip()
    return check_isa(forced) if forced else native_isa()


def apply_isa_cap() -> None:
    """Cap torch at the forced level (``NANOVLLM_CPU_ISA``), leaving any cap the user set alone. Called by
    ``import nanovllm``; a no-op when no level is forced or when it is the CPU's best."""
    forced = os.environ.get(ISA_ENV, "").strip()
    if not forced or forced not in ONEDNN_CAP:  # unset, "amx" (nothing to cap), or a bad name: reported on use
        return
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_CAP[forced])
    os.environ.setdefault("ATEN_CPU_CAPABILITY", ATEN_CAP[forced])


def copy_bandwidth_gbs(megabytes: int = 256, repeats: int = 3) -> float:
    """Memory copy bandwidth in GB/s (bytes read + written, best of ``repeats`` copies of ``megabytes``), one
    thread: the figure that bounds a batch-1 decode step, which reads every weight once."""
    import numpy as np

    src = np.ones(megabytes * 2 ** 20, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def describe(threads: int | None = None, bandwidth: bool = True) -> dict:
    """This machine as a profile or a benchmark records it: CPU model, architecture, the ISA level in force and
    every supported one, threads (``threads``, else torch's if it is imported, else the CPU count) and, with
    ``bandwidth``, the measured copy bandwidth."""
    if threads is None:
        import sys

        torch = sys.modules.get("torch")
        threads = torch.get_num_threads() if torch is not None else os.cpu_count() or 1
    info = {"cpu": cpu_model(), "arch": platform.machine(), "isa": selected_isa(),
            "isa_supported": list(supported_isas()), "threads": int(threads)}
    if bandwidth:
        info["copy_bandwidth_gbs"] = round(copy_bandwidth_gbs(), 1)
    return info


def header(threads: int | None = None, info: dict | None = None) -> str:
    """One line for a benchmark's header: ``CPU: <model> | ISA: <level> (supports ...) | threads | copy GB/s``.
    ``info``: a ``describe()`` result to format (a benchmark that also stores it prints the same figures)."""
    info = describe(threads) if info is None else info
    return (f"CPU: {info['cpu']} ({info['arch']}) | ISA: {info['isa']} (supports {', '.join(info['isa_supported'])})"
            f" | threads: {info['threads']} | copy bandwidth: {info['copy_bandwidth_gbs']} GB/s")
