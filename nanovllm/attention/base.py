"""The attention seam. A backend is planned once per step from the batch layout (``AttentionMetadata``) and
then called by every layer: it writes the step's new K/V into the paged cache and attends over the cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from nanovllm.registry import Registry


@dataclass
class AttentionMetadata:
    """The flat batch of one step, built once by the model runner and handed to the backend's ``plan``.

    Sequences are concatenated in batch order: sequence ``i`` contributes ``query_lens[i]`` consecutive rows
    of the flat batch (its rows start at ``sum(query_lens[:i])``), which are the tokens at positions
    ``num_computed[i] .. seq_lens[i]-1`` of that sequence; its keys and values for positions
    ``0 .. seq_lens[i]-1`` live in the paged cache at the blocks ``block_tables[i]`` (position ``p`` in block
    ``block_tables[i][p // block_size]``, offset ``p % block_size``). ``slot_mapping`` is the one tensor
    (on the model's device); the rest are Python lists so each backend builds the index tensors it needs.
    """

    query_lens: list[int]
    seq_lens: list[int]             # context length after this step (cached + new tokens)
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor      # [num_tokens] cache slot (block * block_size + offset) of each new token
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_computed(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens, self.query_lens)]


class AttentionBackend(ABC):
    """Paged attention for one model. ``kv_caches[layer] = (k_cache, v_cache)``, each of shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    registered_name: str = "custom"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        """Whether this backend can run on ``device`` (e.g. FlashInfer needs CUDA)."""
        return True

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare everything the per-layer calls of this step share (index tensors, masks, kernel plans)."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write ``k``/``v`` ([T, num_kv_heads, head_dim]) into layer ``layer``'s cache at the planned slots,
        then attend: ``q`` is [T, num_heads, head_dim]; returns [T, num_heads * head_dim]."""


ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry(
    "attention backend", base=AttentionBackend, builtin_packages=("nanovllm.attention",),
    engine_args=("num_heads", "num_kv_heads", "head_dim", "scale"),
)


def register_attention(name: str):
    """Class decorator registering an ``AttentionBackend`` subclass under ``name`` (``attention.name=<name>``)."""
    return ATTENTION_BACKENDS.register(name)
