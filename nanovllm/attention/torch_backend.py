"""Reference paged attention in plain torch; runs on CPU and GPU.

Sequences are split into two groups, decodes (one query token) and prefills (chunks, possibly on top of cached
tokens), so that a long prefill does not pad every decode to its length. Each group is padded to a rectangle
once per step in ``plan``: query rows are gathered from the flat batch, keys and values from the cache through
the block tables, and a boolean mask encodes both causality (query ``i`` of a sequence with ``c`` cached tokens
sees keys ``0..c+i``) and padding. Every layer then runs one SDPA call per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanovllm.attention.base import AttentionBackend, AttentionMetadata, register_attention


@dataclass
class _Group:
    token_index: torch.Tensor   # [n_valid] flat-batch rows of this group's real queries, in order
    query_index: torch.Tensor   # [B, max_q] flat-batch row of each padded query slot
    query_valid: torch.Tensor   # [B, max_q] bool
    key_slots: torch.Tensor     # [B, max_kv] cache slot of each padded key position
    mask: torch.Tensor          # [B, 1, max_q, max_kv] bool, True = attend


@register_attention("torch")
class TorchAttention(AttentionBackend):
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
        self._groups = [self._plan_group(meta, seqs, starts, device) for seqs in (decodes, prefills) if seqs]

    @staticmethod
    def _plan_group(meta: AttentionMetadata, seqs: list[int], starts: list[int], device) -> _Group:
        bs = meta.block_size
        q_lens = torch.tensor([meta.query_lens[i] for i in seqs])
        kv_lens = torch.tensor([meta.seq_lens[i] for i in seqs])
        q_start = torch.tensor([starts[i] for i in seqs])
        max_q, max_kv = int(q_lens.max()), int(kv_lens.max())
        q_pos = torch.arange(max_q)
        query_valid = q_pos[None, :] < q_lens[:, None]
        query_index = torch.where(query_valid, q_start[:, None] + q_pos[None, :], 0)
        max_blocks = -(-max_kv // bs)
        tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
        for row, i in enumerate(seqs):
            table = meta.block_tables[i][:max_blocks]
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)
        k_pos = torch.arange(max_kv)
        key_slots = tables[:, k_pos // bs] * bs + (k_pos % bs)[None, :]
        key_valid = k_pos[None, :] < kv_lens[:, None]
        # Absolute position of each query = tokens already cached + its index in the chunk.
        q_abs = (kv_lens - q_lens)[:, None] + q_pos[None, :]
        mask = (k_pos[None, None, :] <= q_abs[:, :, None]) & key_valid[:, None, :]
        # Padded query rows attend to key 0 only, so softmax never sees an all-masked row (NaN).
        mask = mask | (~query_valid[:, :, None] & (k_pos == 0)[None, None, :])
        key_slots = torch.where(key_valid, key_slots, 0)
        return _Group(
            token_index=query_index[query_valid].to(device),
            query_index=query_index.to(device),
            query_valid=query_valid.to(device),
            key_slots=key_slots.to(device),
            mask=mask[:, None].to(device),
        )

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, self._slot_mapping, k.to(flat_k.dtype))
        flat_v.index_copy_(0, self._slot_mapping, v.to(flat_v.dtype))
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        for g in self._groups:
            qg = q[g.query_index].transpose(1, 2)                 # [B, H, max_q, D]
            kg = flat_k[g.key_slots].transpose(1, 2)              # [B, H_kv, max_kv, D]
            vg = flat_v[g.key_slots].transpose(1, 2)
            og = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=g.mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
            )
            og = og.transpose(1, 2)[g.query_valid]               # [n_valid, H, D]
            out[g.token_index] = og.reshape(og.shape[0], -1)
        return out
