"""``AttentionMetadata`` -> the arguments of FlashInfer's paged-KV ``plan()`` calls. Pure torch on CPU, no
flashinfer import: the translation is tested on machines without a GPU (tests/kernels/test_flashinfer_plan.py).

FlashInfer indexes a paged KV cache like a CSR matrix (docs.flashinfer.ai, tutorials "KV-Cache Layout in
FlashInfer", section "Page Table Layout"): request ``i`` owns pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``
in order, its last page holds ``kv_last_page_len[i]`` entries (``1 <= last_page_len <= page_size``), so its KV
length is ``page_size * (num_pages - 1) + last_page_len``. Queries are a ragged tensor: request ``i``'s rows are
``q[qo_indptr[i]:qo_indptr[i+1]]``. Every index array is int32 (the doc warns int64 "can cause indexing
errors").

Our block tables are exactly FlashInfer's page lists (a block is a page, ``block_size`` is ``page_size``);
a table may hold more blocks than the context needs (blocks allocated ahead), so only the first
``ceil(seq_len / block_size)`` are passed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.attention.base import AttentionMetadata


@dataclass(frozen=True)
class PagedKVPlan:
    """What ``BatchPrefillWithPagedKVCacheWrapper.plan`` / ``BatchDecodeWithPagedKVCacheWrapper.plan`` take
    for one step (CPU int32 tensors; FlashInfer copies them to the device when planning)."""

    qo_indptr: torch.Tensor         # [batch + 1] prefix sum of query lengths
    kv_indptr: torch.Tensor         # [batch + 1] prefix sum of pages per request
    kv_indices: torch.Tensor        # [kv_indptr[-1]] the pages of every request, concatenated
    kv_last_page_len: torch.Tensor  # [batch] entries in each request's last page, in 1..page_size
    page_size: int
    is_decode: bool                 # every request has exactly one query token: the decode wrapper applies

    @property
    def batch_size(self) -> int:
        return len(self.kv_last_page_len)


def _indptr(lengths: list[int]) -> torch.Tensor:
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        indptr[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return indptr


def plan_arguments(meta: AttentionMetadata) -> PagedKVPlan:
    """FlashInfer's paged-KV plan arguments for the step described by ``meta``. Raises ``ValueError`` when a
    block table is too short for its sequence (an engine bug, caught here rather than as a wild read)."""
    page_size = meta.block_size
    pages: list[int] = []
    pages_per_seq: list[int] = []
    last_page_len: list[int] = []
    for i, (seq_len, table) in enumerate(zip(meta.seq_lens, meta.block_tables)):
        needed = -(-seq_len // page_size)
        if seq_len < 1 or len(table) < needed:
            raise ValueError(f"sequence {i}: seq_len {seq_len} needs {needed} blocks of {page_size} tokens, "
                             f"its block table has {len(table)}")
        pages.extend(table[:needed])
        pages_per_seq.append(needed)
        last_page_len.append(seq_len - (needed - 1) * page_size)
    return PagedKVPlan(
        qo_indptr=_indptr(meta.query_lens),
        kv_indptr=_indptr(pages_per_seq),
        kv_indices=torch.tensor(pages, dtype=torch.int32),
        kv_last_page_len=torch.tensor(last_page_len, dtype=torch.int32),
        page_size=page_size,
        is_decode=all(q == 1 for q in meta.query_lens),
    )
