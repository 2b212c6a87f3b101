"""Where nano-vllm keeps what it computes once per machine: converted weights, built kernels, per-machine
simulator profiles. A leaf module (it imports nothing of nano-vllm), so the loader, the kernel build and the
simulator all ask it without importing each other.

Everything lives under one root, ``$NANOVLLM_CACHE`` (default ``~/.cache/nanovllm``). The keys inside are
content hashes, never a virtualenv's path, so every clone and venv on a machine shares one cache.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "NANOVLLM_CACHE"
SIM_PROFILES_ENV = "NANOVLLM_SIM_PROFILES"   # the per-machine simulator profiles, when not under the root


def cache_root() -> Path:
    """The cache's root: ``$NANOVLLM_CACHE`` or ``~/.cache/nanovllm``. Converted models sit directly in it
    (``<gguf stem>-<sha256 prefix>/``)."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "nanovllm"))


def kernel_cache_dir() -> Path:
    """Where the built C++ kernels are cached (one directory per build, ``nanovllm.kernels``)."""
    return cache_root() / "extensions"


def sim_profiles_dir() -> Path:
    """The per-machine step-time profiles of ``calibrate --this-machine``: ``$NANOVLLM_SIM_PROFILES``, else
    ``<cache_root()>/sim-profiles``."""
    override = os.environ.get(SIM_PROFILES_ENV, "").strip()
    return Path(override).expanduser() if override else cache_root() / "sim-profiles"
