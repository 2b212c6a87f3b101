"""Reference paged attention in plain torch; runs on CPU and GPU.

Sequences are split into two groups, decodes (one query token) and prefills (chunks, possibly on top of cached
tokens), so that a long prefill does not pad every decode to its length. Each group is padded to a rectangle
once per step in ``plan``: query rows are gathered from the flat batch, keys and values from the cache whole
blocks at a time through the block tables (large contiguous copies), and a boolean mask encodes both causality (query ``i`` of a sequence with ``c`` cached tokens
sees keys ``0..c+i``) and padding. Every layer then runs one SDPA call per group.

8-bit caches (``kv_cache_dtype=int8`` / ``fp8_e4m3``): new K/V are quantized as they are written
(``kv_quant.quantize``), and the gathered blocks dequantized to float32 before SDPA, which then runs in float32
(queries converted, the output converted back), as the C++ kernel computes in float32 whatever the storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanovllm.attention import kv_quant
from nanovllm.attention.base import AttentionBackend, AttentionMetadata, register_attention


@dataclass
class _Group:
    token_index: torch.Tensor   # [n_valid] flat-batch rows of this group's real queries, in order
    query_index: torch.Tensor   # [B, max_q] flat-batch row of each padded query slot
    valid_rows: torch.Tensor | None  # rows of the flattened [B * max_q] padded queries that are real (None: all)
    blocks: torch.Tensor        # [B, max_blocks] cache block of each padded block position
    mask: torch.Tensor          # [B, 1, max_q, max_blocks * block_size] bool, True = attend


@register_attention("torch")
class TorchAttention(AttentionBackend):
    """The reference: padded groups through SDPA, any device; model-dtype and 8-bit caches."""

    kv_cache_dtypes = ("auto", *kv_quant.FORMATS)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._groups: list[_Group] = []
        self._slot_mapping: torch.Tensor | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        self._slot_mapping = meta.slot_mapping
        starts = [0]
        for q in meta.query_lens:
            starts.append(starts[-1] + q)
        decodes = [i for i, q in enumerate(meta.query_lens) if q == 1]
        prefills = [i for i, q in enumerate(meta.query_lens) if q > 1]
        self._groups = [plan_padded_group(meta, seqs, starts, device) for seqs in (decodes, prefills) if seqs]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]
        slots = self._slot_mapping
        assert slots is not None, "plan() runs before forward()"
        fmt = kv_quant.format_of_cache(k_cache)
        row = k_cache.shape[-1]  # head_dim, or head_dim + 4 for an 8-bit cache's packed rows
        flat_k = k_cache.view(-1, self.num_kv_heads, row)
        flat_v = v_cache.view(-1, self.num_kv_heads, row)
        if fmt is None:
            flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
            flat_v.index_copy_(0, slots, v.to(flat_v.dtype))
        else:
            flat_k.index_copy_(0, slots, kv_quant.quantize(k, fmt))
            flat_v.index_copy_(0, slots, kv_quant.quantize(v, fmt))
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        for g in self._groups:
            attend_padded_group(g, q, k_cache, v_cache, self.scale, out)
        return out


def plan_padded_group(meta: AttentionMetadata, seqs: list[int], starts: list[int], device) -> _Group:
    """The padded rectangle, block list and mask of sequences ``seqs`` (``starts``: flat-batch offsets)."""
    bs = meta.block_size
    q_lens = torch.tensor([meta.query_lens[i] for i in seqs])
    kv_lens = torch.tensor([meta.seq_lens[i] for i in seqs])
    q_start = torch.tensor([starts[i] for i in seqs])
    max_q, max_kv = int(q_lens.max()), int(kv_lens.max())
    q_pos = torch.arange(max_q)
    query_valid = q_pos[None, :] < q_lens[:, None]
    query_index = torch.where(query_valid, q_start[:, None] + q_pos[None, :], 0)
    max_blocks = -(-max_kv // bs)
    blocks = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
    for row, i in enumerate(seqs):
        table = meta.block_tables[i][:max_blocks]
        blocks[row, : len(table)] = torch.tensor(table, dtype=torch.long)
    k_pos = torch.arange(max_blocks * bs)
    key_valid = k_pos[None, :] < kv_lens[:, None]
    # Absolute position of each query = tokens already cached + its index in the chunk.
    q_abs = (kv_lens - q_lens)[:, None] + q_pos[None, :]
    mask = (k_pos[None, None, :] <= q_abs[:, :, None]) & key_valid[:, None, :]
    # Padded query rows attend to key 0 only, so softmax never sees an all-masked row (NaN).
    mask = mask | (~query_valid[:, :, None] & (k_pos == 0)[None, None, :])
    return _Group(
        token_index=query_index[query_valid].to(device),
        query_index=query_index.to(device),
        valid_rows=None if bool(query_valid.all()) else query_valid.view(-1).nonzero().view(-1).to(device),
        blocks=blocks.to(device),
        mask=mask[:, None].to(device),
    )


def attend_padded_group(g: _Group, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                        out: torch.Tensor) -> None:
    """SDPA over one planned group; writes its real query rows into ``out`` ([T, num_heads * head_dim]). An 8-bit
    cache's gathered blocks are dequantized and the group attends in float32."""
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    fmt = kv_quant.format_of_cache(k_cache)
    # index_select, not advanced indexing: the same gather runs several times faster on CPU.
    batch, max_q = g.query_index.shape
    max_blocks = g.blocks.shape[1]
    qg = q.index_select(0, g.query_index.view(-1)).view(batch, max_q, num_heads, head_dim)
    kg = k_cache.index_select(0, g.blocks.view(-1))
    vg = v_cache.index_select(0, g.blocks.view(-1))
    if fmt is not None:
        qg, kg, vg = qg.float(), kv_quant.dequantize(kg, fmt), kv_quant.dequantize(vg, fmt)
    shape = (batch, max_blocks * block_size, num_kv_heads, head_dim)
    og = F.scaled_dot_product_attention(
        qg.transpose(1, 2), kg.view(shape).transpose(1, 2), vg.view(shape).transpose(1, 2),
        attn_mask=g.mask, scale=scale, enable_gqa=num_heads != num_kv_heads,
    )
    og = og.transpose(1, 2).reshape(batch * max_q, -1).to(out.dtype)
    if g.valid_rows is not None:
        og = og.index_select(0, g.valid_rows)
    out.index_copy_(0, g.token_index, og)
