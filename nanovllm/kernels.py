"""nano-vllm's CPU kernels (``nanovllm/csrc``): paged attention, RMSNorm and rotary embedding in C++, built with
torch's extension tooling (g++ and ninja) on first use and cached, so a fresh machine needs no build step.

The build is keyed by the sources, the flags, the torch version and the CPU's feature flags (it is compiled
with ``-march=native``), under ``$NANOVLLM_CACHE/extensions`` (default ``~/.cache/nanovllm``). The first build
takes ~30-60 s; later processes load the cached library at once.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("paged_attention.cpp", "fused_ops.cpp", "sampling.cpp", "gemv.cpp", "bindings.cpp")]
HEADERS = [CSRC / "cpu_vec.h"]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def _cpu_fingerprint() -> str:
    """The CPU's feature flags, so a cache shared between machines never hands one CPU's build to another."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def extension_dir() -> Path:
    """Where built kernels are cached."""
    from nanovllm.models.loader import cache_root

    return cache_root() / "extensions"


# A build takes 1-3 minutes; torch's lock file older than this was left by a build that was killed (Ctrl-C
# during the first run), and torch would wait for it forever.
STALE_LOCK_S = 20 * 60


def _remove_stale_lock(build_dir: Path) -> None:
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        warnings.warn(f"removing {lock}, left {age / 60:.0f} minutes ago by an interrupted kernel build", stacklevel=3)
        lock.unlink(missing_ok=True)


@functools.cache
def load():
    """The compiled extension module. Raises ``RuntimeError`` saying what is missing if the build fails."""
    from torch.utils import cpp_extension

    # torch's install path is part of the key: the build files name it, so two virtualenvs sharing one key
    # would rebuild each other's library on every load.
    key = "\n".join([*(p.read_text() for p in SOURCES + HEADERS), " ".join(CFLAGS), torch.__version__,
                     str(Path(torch.__file__).parent), _cpu_fingerprint()])
    name = f"nanovllm_kernels_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    build_dir = extension_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_lock(build_dir)
    try:
        return cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                                  extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:
        raise RuntimeError(
            f"could not build nano-vllm's CPU kernels ({exc}); they need g++ and the ninja package "
            "(pip install ninja). attention='torch' with dtype='float32' runs without them."
        ) from exc
