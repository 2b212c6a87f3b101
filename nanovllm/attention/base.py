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

    # CUDA-graph decode (nanovllm/engine/cuda_graphs.py) replays captured kernels, so every tensor the layers
    # read must stay at one address from step to step. A backend that keeps to that in ``plan_cuda_graph``
    # says so here; the engine runs every step of the others eagerly.
    supports_cuda_graphs: bool = False

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` (e.g. FlashInfer needs CUDA and its package), or None."""
        return None

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        """Whether this backend can run on ``device``."""
        return cls.unavailable_reason(device) is None

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare everything the per-layer calls of this step share (index tensors, masks, kernel plans)."""

    def prepare_cuda_graphs(self, batch_sizes: list[int], max_num_pages: int) -> None:
        """Called once before decode graphs of ``batch_sizes`` are captured: allocate the fixed buffers they
        will read (``max_num_pages`` bounds the pages of one batch). Nothing to allocate by default."""

    def plan_cuda_graph(self, meta: AttentionMetadata, batch_size: int) -> None:
        """Plan a decode-only step already padded to ``batch_size`` rows for the graph captured at that size,
        writing only into fixed buffers. The default plans as usual, which is right only where ``plan``
        allocates nothing the layers read (on CPU, with the test double of a graph)."""
        self.plan(meta)

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
