"""``host``: a second pool of K/V blocks in this process's memory (CPU RAM), bounded in bytes."""

from __future__ import annotations

import torch

from nanovllm.kv_tiers import KVTier, TierContext, Tokens, register_kv_tier


@register_kv_tier("host")
class HostTier(KVTier):
    """Blocks as tensors in a dict. ``capacity`` bytes (default 1 GiB), ``eviction`` ``lru`` | ``lfu`` |
    ``fifo``, ``kv_dtype`` ``auto`` | ``int8``."""

    def __init__(self, context: TierContext, capacity: int = 1 << 30, eviction: str = "lru",
                 kv_dtype: str = "auto") -> None:
        super().__init__(context, capacity, eviction, kv_dtype)
        self._data: dict[int, tuple[Tokens, torch.Tensor]] = {}

    def _write(self, key: int, tokens: Tokens, data: torch.Tensor) -> int:
        self._data[key] = (tokens, data)
        return data.numel() * data.element_size()

    def _read(self, key: int, tokens: Tokens | None) -> torch.Tensor | None:
        stored = self._data.get(key)
        if stored is None or (tokens is not None and stored[0] != tokens):
            return None
        return stored[1]

    def _remove(self, key: int) -> None:
        self._data.pop(key, None)
