"""TEST HELPER ONLY: what FlashInfer's batch paged-KV attention computes, in plain torch, written from its
documentation so that the plan arguments built by ``nanovllm.attention.flashinfer_plan`` can be checked on a
machine without a GPU. The engine never imports this; on a GPU the real kernels are checked instead
(tests/kernels/test_gpu.py).

The definitions it follows, from docs.flashinfer.ai:

- Tutorial "KV-Cache Layout in FlashInfer", section "Layout: NHD/HND": the last three dimensions of a page
  are ``(seq_len, num_heads, head_dim)`` for ``NHD`` and ``(num_heads, seq_len, head_dim)`` for ``HND``; with
  K and V kept as a tuple, each is ``[max_num_pages, page_size, num_kv_heads, head_dim]`` (NHD).
- Same tutorial, section "Page Table Layout": request ``i``'s pages are
  ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``; "The KV sequence length of request i is
  ``page_size * (len(page_indices[i]) - 1) + last_page_len[i]``"; ``1 <= last_page_len <= page_size``.
- Section "Ragged Tensor": request ``i``'s queries are ``q[qo_indptr[i]:qo_indptr[i+1]]``.
- ``BatchPrefillWithPagedKVCacheWrapper`` docstring: with ``causal=True`` the mask equals the custom mask
  ``torch.tril(ones(qo_len, kv_len), diagonal=kv_len - qo_len)`` (its example asserts the two outputs match),
  i.e. the queries are the last ``qo_len`` positions of the ``kv_len`` keys. ``sm_scale`` defaults to
  ``1 / sqrt(head_dim)``. "If num_qo_heads is not equal to num_kv_heads, the function will use grouped query
  attention": query head ``h`` reads KV head ``h // (num_qo_heads // num_kv_heads)``.
- ``BatchDecodeWithPagedKVCacheWrapper``: one query per request attending to its whole KV sequence, which is
  the causal rule above with ``qo_len = 1``.
"""

from __future__ import annotations

import torch

from nanovllm.attention.flashinfer_plan import PagedKVPlan


def batch_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PagedKVPlan,
    sm_scale: float | None = None, causal: bool = True, kv_layout: str = "NHD",
) -> torch.Tensor:
    """``q``: [qo_indptr[-1], num_qo_heads, head_dim]; ``k_cache``/``v_cache``: 4-D paged caches in
    ``kv_layout``. Returns the attention output, shaped like ``q`` (computed in float32)."""
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    elif kv_layout != "NHD":
        raise ValueError(f"kv_layout must be NHD or HND, got {kv_layout!r}")
    num_qo_heads, head_dim = q.shape[1], q.shape[2]
    group = num_qo_heads // k_cache.shape[2]
    scale = sm_scale if sm_scale is not None else head_dim ** -0.5
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(plan.batch_size):
        pages = plan.kv_indices[plan.kv_indptr[i]:plan.kv_indptr[i + 1]].long()
        kv_len = plan.page_size * (len(pages) - 1) + int(plan.kv_last_page_len[i])
        keys = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv_len].float()
        values = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv_len].float()
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        rows = slice(int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1]))
        qi = q[rows].float()
        scores = torch.einsum("qhd,khd->hqk", qi, keys) * scale
        if causal:
            qo_len = qi.shape[0]
            allowed = torch.ones(qo_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - qo_len)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out
