"""Fast paged attention for CPU: a small C++ kernel (``csrc/paged_attention.cpp``), built with torch's
extension tooling on first use and cached.

Why a C++ kernel and not SDPA or FlexAttention: a decode step is one query row per sequence against ~100-1000
cached keys. The reference backend gathers every sequence's blocks into a padded rectangle and builds a mask,
and that copying, not arithmetic, is what the step pays for; FlexAttention on CPU compiles per shape and still
works on padded rectangles. The kernel reads keys straight from the block table, so a step costs what its
query-key pairs cost. One kernel call per layer also writes the new K/V into the cache.

``plan`` builds, once per step, the only metadata the kernel needs: each token's sequence index and absolute
position, and the block tables as one int32 tensor. Prefill chunks over a cached prefix are ordinary tokens
whose position says how many keys they see. GQA: each kernel work item serves all query heads of one KV head.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

import torch

from nanovllm.attention.base import AttentionBackend, AttentionMetadata, register_attention

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def _cpu_fingerprint() -> str:
    """The CPU's feature flags: the kernel is built with -march=native, so a cache shared between machines
    must not hand one CPU's build to another."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def extension_dir() -> Path:
    """Where built kernels are cached: ``$NANOVLLM_CACHE/extensions`` (default ``~/.cache/nanovllm``)."""
    from nanovllm.models.loader import cache_root

    return cache_root() / "extensions"


@functools.cache
def load_kernel():
    """The compiled extension module (built on the first call in a fresh cache, ~30 s; later loads are
    instant). Raises ``RuntimeError`` saying what to install if the build fails."""
    from torch.utils import cpp_extension

    key = "\n".join([_SOURCE.read_text(), " ".join(_CFLAGS), torch.__version__, _cpu_fingerprint()])
    name = f"nanovllm_paged_attention_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    build_dir = extension_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                                  extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:
        raise RuntimeError(
            f"could not build the cpu attention kernel ({exc}); it needs g++ and the ninja package "
            "(pip install ninja). Use attention='torch' to run without it."
        ) from exc


@register_attention("cpu")
class CpuAttention(AttentionBackend):
    """Paged attention on CPU through the C++ kernel; float32, bfloat16 and float16 caches."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._kernel = load_kernel()
        self._slot_mapping = torch.empty(0, dtype=torch.long)
        self._block_tables = torch.empty(0, 0, dtype=torch.int32)
        self._seq = torch.empty(0, dtype=torch.int32)
        self._pos = torch.empty(0, dtype=torch.int32)

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        return torch.device(device).type == "cpu"

    def plan(self, meta: AttentionMetadata) -> None:
        query_lens = torch.tensor(meta.query_lens, dtype=torch.int32)
        seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
        self._seq = torch.repeat_interleave(torch.arange(meta.num_seqs, dtype=torch.int32), query_lens)
        # Token j of sequence i's chunk sits at position seq_lens[i] - query_lens[i] + j and sees that many
        # keys plus itself.
        starts = torch.cumsum(query_lens, 0) - query_lens
        offsets = torch.arange(int(query_lens.sum()), dtype=torch.int32) - starts[self._seq]
        self._pos = ((seq_lens - query_lens)[self._seq] + offsets).to(torch.int32)
        width = max(len(t) for t in meta.block_tables)
        self._block_tables = torch.tensor([t + [0] * (width - len(t)) for t in meta.block_tables], dtype=torch.int32)
        self._slot_mapping = meta.slot_mapping

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]
        return self._kernel.paged_attention(
            q, k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, self._slot_mapping,
            self._block_tables, self._seq, self._pos, self.scale,
        )
