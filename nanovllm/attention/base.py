"""The attention seam. A backend is planned once per step from the batch layout (``AttentionMetadata``) and
then called by every layer: it writes the step's new K/V into the paged cache and attends over the cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from nanovllm.registry import Registry


@dataclass
class AttentionMetadata:
    """The flat batch of one step. Sequence ``i`` contributes tokens ``query_start_loc[i]:query_start_loc[i+1]``
    of the flat batch, at positions ``num_computed[i] .. seq_lens[i]-1`` of its sequence.

    Python lists and CPU tensors are both kept: backends build what they need in ``plan``.
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
    "attention backend", base=AttentionBackend, builtin_packages=("nanovllm.attention",)
)


def register_attention(name: str):
    """Class decorator registering an ``AttentionBackend`` subclass under ``name`` (``attention.name=<name>``)."""
    return ATTENTION_BACKENDS.register(name)


AUTO = "auto"


def default_attention_name(device: torch.device | str) -> str:
    """What ``attention="auto"`` (the default) means on ``device``: the C++ kernel on CPU, the torch reference
    elsewhere."""
    return "cpu" if torch.device(device).type == "cpu" else "torch"


def resolve_attention(spec: Any, device: torch.device | str) -> Any:
    """``spec`` (a name, a ``{"name": ...}`` mapping or an instance) with the name ``auto`` resolved for
    ``device``; anything else is returned as is."""
    if isinstance(spec, str) and spec == AUTO:
        return default_attention_name(device)
    if isinstance(spec, Mapping) and spec.get("name") == AUTO:
        return {**spec, "name": default_attention_name(device)}
    return spec
