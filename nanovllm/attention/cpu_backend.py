"""Fast paged attention for CPU: a small C++ kernel (``nanovllm/csrc/paged_attention.cpp``, built and cached by
``nanovllm.kernels`` on first use).

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

import torch

from nanovllm import kernels
from nanovllm.attention.base import AttentionBackend, AttentionMetadata, register_attention


@register_attention("cpu")
class CpuAttention(AttentionBackend):
    """Paged attention on CPU through the C++ kernel; float32, bfloat16 and float16 caches."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._kernel = kernels.load()
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
