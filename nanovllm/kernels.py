"""nano-vllm's CPU kernels (``nanovllm/csrc``): paged attention, RMSNorm, rotary embedding, greedy sampling and
the bf16 GEMV in C++, built with torch's extension tooling (g++ and ninja) on first use and cached, so a fresh
machine needs no build step.

One build per ISA level (``nanovllm.machine``): the sources choose their vector path at compile time
(``__AVX512BF16__``, ``__AVX512F__``, else portable loops), so each level is compiled with its own explicit
flags, never ``-march=native``, and ``load()`` takes the level in force (the CPU's best, or the lower one
``NANOVLLM_CPU_ISA`` forces). Any supported level can be loaded beside the others (``load("avx2")``): the tests
run every path the machine has.

The cache (``$NANOVLLM_CACHE/extensions``, default ``~/.cache/nanovllm``) is keyed by the sources, the flags,
the compiler and the torch version, not by the virtualenv's path: every clone and venv on a machine shares one
build, loaded straight from its ``.so`` once its ``built`` marker says the build finished (never a half-linked
one). Builders take an OS file lock (``filelock``: released by the kernel when its holder dies, however it
dies), so a build interrupted by Ctrl-C or a kill never blocks a later start; a process that waits for
another's build says so once on stderr.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Protocol, cast

import filelock
import torch

from nanovllm import machine
from nanovllm.paths import kernel_cache_dir

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("paged_attention.cpp", "fused_ops.cpp", "sampling.cpp", "gemv.cpp", "quant_gemm.cpp",
                                       "int8_amx.cpp", "brgemm_linear.cpp", "bf16_fma_linear.cpp",
                                       "decoder_stack.cpp", "kv_copy.cpp",
                                       "bindings.cpp")]
# The one unit the compiler is given: it includes every source above (a unity build), so the torch headers
# are parsed once a build rather than once a source.
UNITY_SOURCE = CSRC / "all_kernels.cpp"
HEADERS = [CSRC / "cpu_vec.h", CSRC / "kernels.h", CSRC / "scratch.h"]
CFLAGS = ["-O3", "-fopenmp"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# The compiler flags of each kernel build. AMX is oneDNN's (torch's matmuls): our kernels run the bf16 build there.
ISA_CFLAGS: dict[str, list[str]] = {
    "avx512_bf16": [*_AVX512, "-mavx512bf16", "-mavx512vnni"],
    "avx512": _AVX512,
    "avx2": _AVX2,
    "scalar": [],
}


class StackLinear(Protocol):
    """One linear of a ``DecoderStack`` (``stack_linear``'s result): opaque to Python, handed to ``add_layer``."""


class CompiledDecoderStack(Protocol):
    """The fast path's decoder layers as one C++ loop (``csrc/decoder_stack.cpp``)."""

    def add_layer(self, input_norm: torch.Tensor, post_norm: torch.Tensor, qkv: StackLinear, o: StackLinear,
                  gate_up: StackLinear, down: StackLinear) -> None: ...

    def num_layers(self) -> int: ...

    def forward(self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor], slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                seq: torch.Tensor, pos: torch.Tensor, eight_bit_cache: bool, scale: float) -> torch.Tensor: ...


class Kernels(Protocol):
    """The compiled kernel module ``load()`` returns: the functions ``csrc/bindings.cpp`` binds (declared in
    ``csrc/kernels.h``), the classes of ``csrc/decoder_stack.cpp``, and what ``load()`` adds (``isa`` and the
    linears as torch operators, ``*_op``). The extension is built at run time, so this is its type."""

    isa: str
    gemv_bf16_op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    quant_linear_op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                               torch.Tensor | None, int], torch.Tensor]
    brgemm_linear_op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]
    int8_amx_linear_op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int, int],
                                 torch.Tensor]
    q4x16_linear_op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int],
                              torch.Tensor]
    i8x16_linear_op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]
    q8x16_linear_op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]
    bf16_fma_linear_op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        seq: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor: ...

    def paged_attention_8bit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                             seq: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm_(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None: ...

    def greedy_sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gemv_available(self) -> bool: ...

    def gemv_bf16(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def quant_linear(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     bias: torch.Tensor | None, format: int) -> torch.Tensor: ...

    def quant_gemm_isa(self) -> str: ...

    def q4x16_available(self) -> bool: ...

    def i8x16_available(self) -> bool: ...

    def q8x16_available(self) -> bool: ...

    def q4x16_linear(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                     bias: torch.Tensor | None, out_features: int) -> torch.Tensor: ...

    def i8x16_linear(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor: ...

    def q8x16_linear(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor: ...

    def int8_amx_available(self) -> bool: ...

    def pack_int8_amx(self, codes: torch.Tensor) -> torch.Tensor: ...

    def int8_amx_linear(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None, out_features: int, digits: int = 2) -> torch.Tensor: ...

    def brgemm_bf16_available(self) -> bool: ...

    def pack_brgemm_weight(self, weight: torch.Tensor) -> torch.Tensor: ...

    def brgemm_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor: ...

    def bf16_fma_available(self) -> bool: ...

    def pack_bf16_fma_weight(self, weight: torch.Tensor) -> torch.Tensor: ...

    def bf16_fma_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                        out_features: int) -> torch.Tensor: ...

    def kv_copy_isa(self) -> str: ...

    def copy_kv_blocks(self, pool: torch.Tensor, src: torch.Tensor, runs: torch.Tensor) -> None: ...

    def stack_linear(self, kind: str, weight: torch.Tensor, scales: torch.Tensor | None, mins: torch.Tensor | None,
                     bias: torch.Tensor | None, out_features: int, format: int = 0,
                     gemv_weight: torch.Tensor | None = None, gemv_max_rows: int = 0,
                     activation_digits: int = 2) -> StackLinear: ...

    # A class in the module (pybind11's ``py::class_``); its constructor, as called.
    def DecoderStack(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                     final_norm: torch.Tensor) -> CompiledDecoderStack: ...


def kernel_build(level: str) -> str:
    """The kernel build that serves ISA ``level`` (``amx`` runs the ``avx512_bf16`` build)."""
    return "avx512_bf16" if level == "amx" else level


def kv_copy_variant(build: str) -> str:
    """The store path ``copy_kv_blocks`` (``csrc/kv_copy.cpp``: K/V blocks into the paged pool with streaming
    stores) takes in kernel build ``build``: ``avx512`` (64-byte stores, the two AVX-512 builds), ``avx2`` (32),
    ``sse2`` (16: the scalar build on x86-64, whose baseline has SSE2) or ``memcpy`` (another architecture). Pure
    but for the architecture (``platform.machine``), so tests can ask it for CPUs they do not run on; the built
    module's ``kv_copy_isa()`` says the same of itself."""
    if machine.platform.machine().lower() not in ("x86_64", "amd64"):
        return "memcpy"
    return {"avx512_bf16": "avx512", "avx512": "avx512", "avx2": "avx2"}.get(build, "sse2")


@functools.cache
def _compiler_version() -> str:
    try:
        out = subprocess.run(["c++", "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else "unknown compiler"
    except (OSError, subprocess.SubprocessError):
        return "no compiler"


def build_name(build: str) -> str:
    """The cache entry of one kernel build: its level and a hash of everything that makes its bytes."""
    texts = [p.read_text() for p in [UNITY_SOURCE, *SOURCES, *HEADERS]]
    key = "\n".join([*texts, " ".join(CFLAGS + ISA_CFLAGS[build]), _compiler_version(), torch.__version__,
                     sys.version.split()[0]])
    return f"nanovllm_kernels_{build}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _import_built(name: str, library: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build(name: str, build: str, build_dir: Path) -> None:
    from torch.utils import cpp_extension

    # torch's own lock file ("lock") outlives a killed build and makes torch wait for it forever; whoever holds
    # our OS lock is the only builder, so one found now is stale.
    (build_dir / "lock").unlink(missing_ok=True)
    cpp_extension.load(name=name, sources=[str(UNITY_SOURCE)],
                       extra_cflags=CFLAGS + ISA_CFLAGS[build] + [f"-DNANOVLLM_OPS=nanovllm_{build}"],
                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


@functools.cache
def load(level: str | None = None) -> Kernels:
    """The compiled kernels for ISA ``level`` (None: the level in force, ``machine.selected_isa()``), built on
    first use. The module also carries ``isa`` (its build's level) and ``gemv_bf16_op`` and ``quant_linear_op`` (the
    GEMV and the quantized GEMM as torch operators, which profiles count as linears). Raises ``ValueError`` for a level the CPU lacks and
    ``RuntimeError`` saying what is missing if the build fails."""
    level = machine.check_isa(level, "isa") if level is not None else machine.selected_isa()
    build = kernel_build(level)
    name = build_name(build)
    build_dir = kernel_cache_dir() / name
    library = build_dir / f"{name}.so"
    # The linker writes the .so in place, so its existence says nothing: another process may be mid-link (a
    # load then fails with "file too short"). The marker is made only after a whole build, under the lock.
    ready = build_dir / "built"
    try:
        if not ready.exists():
            build_dir.mkdir(parents=True, exist_ok=True)
            with _build_lock(build_dir / "build.lock"):
                if not ready.exists():  # another process may have built it while we waited
                    _build(name, build, build_dir)
                    ready.touch()
        module = _import_built(name, library)
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as exc:
        raise RuntimeError(
            f"could not build nano-vllm's CPU kernels ({exc}); they need g++ and the ninja package "
            "(pip install ninja). attention='torch' with dtype='float32' runs without them."
        ) from exc
    # The one place the built module gets its type: an extension module has no static attributes to check.
    compiled = cast(Kernels, module)
    compiled.isa = build
    ops = getattr(torch.ops, f"nanovllm_{build}")
    compiled.gemv_bf16_op = ops.gemv_bf16
    compiled.quant_linear_op = ops.quant_linear
    compiled.brgemm_linear_op = ops.brgemm_linear
    compiled.int8_amx_linear_op = ops.int8_amx_linear
    compiled.q4x16_linear_op = ops.q4x16_linear
    compiled.i8x16_linear_op = ops.i8x16_linear
    compiled.q8x16_linear_op = ops.q8x16_linear
    compiled.bf16_fma_linear_op = ops.bf16_fma_linear
    return compiled


class _build_lock:
    """The OS lock over one build directory; says once on stderr when it has to wait for another process."""

    def __init__(self, path: Path) -> None:
        self.lock = filelock.FileLock(str(path))

    def __enter__(self) -> None:
        try:
            self.lock.acquire(timeout=0)
        except filelock.Timeout:
            print(f"nano-vllm: waiting for another process's kernel build ({self.lock.lock_file})", file=sys.stderr,
                  flush=True)
            self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
