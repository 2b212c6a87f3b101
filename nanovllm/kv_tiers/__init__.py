"""The KV tier seam: where K/V blocks live below the primary pool (the KV cache the model attends over).

A ``KVTier`` stores blocks of K/V by key: a full prompt block under its ``prefix_block_key`` (the same key the
prefix-caching allocators use, so a key means the same tokens after the same prefix in every process), or a
preempted request's blocks under a swap key. It owns its capacity (bytes) and drops entries in the order of an
``EvictionPolicy`` (``lru``, ``lfu``, ``fifo``: the allocators' registry). The engine never reads a tier's
internals: ``nanovllm.engine.kv_offload.KVOffload`` stacks tiers (``host`` then ``disk``), asks the offload
policy (``nanovllm.kv_tiers.offload``) what goes down and copies blocks between the primary pool and the tiers.

When the engine calls what (all from the engine's own thread, within a step):

* ``put``: a block goes down (the primary pool evicted it, a prefill wrote it through, a request was swapped
  out, or the tier above evicted it and the policy demotes it).
* ``contains``: prefix lookups (``cached_prefix_len``, admission) ask which tier holds each next block; it
  changes nothing (no recency, no counts).
* ``get_many``: admission loads a run of next blocks back into the primary pool (the default calls ``get`` per
  block; ``host`` hands a run out as views of its slabs); it stops at the first block missing or corrupt, and
  the engine computes from there.
* ``get``: a swap-in, or a prefetch promoting a block to the tier above; ``None`` means missing or corrupt.
* ``discard``: a swapped request resumed, or was aborted.
* ``close``: the engine is done (a tier removes what it must not leave behind).

Choose tiers with ``kv_offload=host`` (Hydra) or ``LLM(kv_offload=dict(name="host", capacity=2**30,
below=dict(name="disk", path="/tmp/kv", capacity=2**33)))``; a plugin subclasses ``KVTier`` and registers it
with ``@register_kv_tier("name")``. See docs/kv_tiers.md.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Callable

import torch

from nanovllm.attention.kv_quant import FORMATS, dequantize, format_of_cache, quantize
from nanovllm.eviction import EvictionTracker
from nanovllm.registry import Registry

logger = logging.getLogger(__name__)

Tokens = tuple[int, ...]


@dataclass(frozen=True)
class TierContext:
    """What the engine tells each tier it builds: ``namespace`` fingerprints the model and the KV geometry and
    format (entries of another model, dtype or block size never match: a disk tier keeps them apart), and
    ``dtype`` is the primary cache's storage dtype, what ``get`` returns. ``payload`` False: the simulator's
    payload-free mode (``runner=sim``): blocks arrive as ``meta`` tensors (a shape and a dtype, no data), and a
    tier keeps the same bookkeeping (capacity in bytes, eviction order, keys and tokens) without storing data,
    so the simulated engine runs the same tier and offload-policy classes as the real one."""

    namespace: str
    dtype: torch.dtype
    payload: bool = True


@dataclass
class _Entry:
    slot: int               # the id the eviction tracker knows this entry by
    tokens: Tokens | None   # the tokens it holds (None: adopted from storage, checked when read)
    num_bytes: int
    pinned: bool            # swapped-out blocks: never evicted, only discarded


class KVTier(abc.ABC):
    """A bounded store of K/V blocks by key (see the module docstring for when the engine calls what).

    ``capacity``: bytes it may hold. ``eviction``: a registered eviction order. ``kv_dtype``: ``auto`` stores
    blocks as the primary cache holds them; ``int8`` stores model-dtype K/V as 8-bit codes with a float32 scale
    per token and head (``nanovllm.attention.kv_quant``), about twice the blocks per byte, and lossy (loaded
    blocks no longer give the exact reference's tokens). Subclasses implement the storage: ``_write``,
    ``_read``, ``_remove`` (and ``_adopt`` for storage that outlives the process or is shared), and may override
    ``get_many`` to read a run of blocks in fewer pieces."""

    registered_name: str = "custom"

    def __init__(self, context: TierContext, capacity: int = 1 << 30, eviction: str = "lru",
                 kv_dtype: str = "auto") -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"kv_offload: {type(self).__name__} capacity must be a number of bytes >= 1, "
                             f"got {capacity!r}")
        if kv_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_offload: kv_dtype must be auto or int8, got {kv_dtype!r}")
        self.context = context
        self.capacity = capacity
        self.kv_dtype = kv_dtype
        self._tracker = EvictionTracker(eviction)
        self._entries: dict[int, _Entry] = {}
        self._key_of_slot: dict[int, int] = {}
        self._slots = 0
        self.used_bytes = 0
        # Set by the engine's stack: an evicted entry (key, tokens, decoded K/V) may go down a tier.
        self.on_evict: Callable[[int, Tokens, torch.Tensor], None] | None = None

    @property
    def name(self) -> str:
        return self.registered_name

    # -- what subclasses store -------------------------------------------------------------------------------
    @abc.abstractmethod
    def _write(self, key: int, tokens: Tokens, data: torch.Tensor) -> int:
        """Store ``data`` (already encoded) under ``key``; return the bytes it takes. Raise ``OSError`` if not."""

    @abc.abstractmethod
    def _read(self, key: int, tokens: Tokens | None) -> torch.Tensor | None:
        """The encoded data under ``key``, or None when it is gone, corrupt, or holds other ``tokens``."""

    @abc.abstractmethod
    def _remove(self, key: int) -> None:
        """Drop ``key``'s data (a no-op when it is already gone)."""

    def _adopt(self, key: int) -> int | None:
        """Bytes of an entry under ``key`` this tier did not write in this process (an earlier run, another
        process), or None. Default: none (storage that lives and dies with the process)."""
        return None

    # -- the interface the engine uses -----------------------------------------------------------------------
    def contains(self, key: int) -> bool:
        """Whether ``key`` can be asked for now (a pure lookup)."""
        return key in self._entries or self._adopt_entry(key)

    def put(self, key: int, tokens: Tokens, data: torch.Tensor, pinned: bool = False) -> bool:
        """Store ``data`` (K/V as the primary cache holds it) under ``key``, evicting unpinned entries as the
        eviction order says; False when it cannot fit (the tier is full of pinned entries, or it is smaller
        than ``data``) or the storage failed."""
        if key in self._entries:
            return True
        encoded = self._encode(data)
        num_bytes = encoded.numel() * encoded.element_size()
        if num_bytes > self.capacity - self._pinned_bytes():
            return False
        while self.used_bytes + num_bytes > self.capacity:
            self._evict_one()
        try:
            num_bytes = self._write(key, tokens, encoded)
        except OSError as exc:
            logger.warning("kv tier %s: writing a block failed (%s); it stays uncached", self.name, exc)
            return False
        self._add(key, _Entry(self._next_slot(), tokens, num_bytes, pinned))
        return True

    def get(self, key: int, tokens: Tokens | None) -> torch.Tensor | None:
        """The K/V under ``key`` in the primary cache's dtype (counted as a use), or None when it is missing,
        corrupt or holds other tokens; such an entry is forgotten. It may be a view of the tier's storage
        (``host``), valid until the tier next changes (a put, discard or eviction): copy it before then."""
        if not self.contains(key):
            return None
        data = self._read(key, tokens)
        entry = self._entries[key]
        if data is None:
            self._drop(key)
            return None
        if not entry.pinned:
            self._tracker.hit(entry.slot)
        return self._decode(data)

    def get_many(self, blocks: Sequence[tuple[int, Tokens | None]]) -> list[torch.Tensor]:
        """Batched ``get``: the K/V of ``blocks`` (key, tokens) in order, as pieces ``[layers, 2, k, ...]`` whose
        concatenation along dimension 2 is the blocks found, up to the first that is missing or corrupt (that one
        is forgotten, as ``get`` forgets it; the caller computes from there). Each block counts as a use.
        ``KVOffload.load`` calls it at admission for each run of next blocks this tier holds, then copies each
        piece into the primary pool. Default: ``get`` per block, one piece each; a tier whose storage can hand
        out several blocks as one tensor overrides it (``host``: a view of its slabs), so the pool takes them in
        fewer copies. A piece may be a view of the tier's storage, valid until the tier next changes."""
        pieces: list[torch.Tensor] = []
        for key, tokens in blocks:
            data = self.get(key, tokens)
            if data is None:
                break
            pieces.append(data)
        return pieces

    def discard(self, key: int) -> None:
        """Forget ``key`` (a swapped request resumed or ended)."""
        if key in self._entries:
            self._drop(key)

    def num_entries(self) -> int:
        return len(self._entries)

    def keys(self) -> set[int]:
        """The keys a prefix lookup can find here now (swapped-out entries left out): what a Ray replica reports
        to the driver's mirror of its tiers (``RayCluster``'s tier-aware router views)."""
        return {key for key, entry in self._entries.items() if not entry.pinned}

    def put_once(self, key: int, tokens: Tokens, data: torch.Tensor) -> None:
        """Store ``data`` for one reader (``take``), possibly in another process sharing this tier's storage: not
        indexed, counted against capacity or evicted here (``kv_transfer=shared_store`` hands a prompt's partial
        last block over this way). Raises ``OSError`` when the storage fails."""
        self._write(key, tokens, self._encode(data))

    def take(self, key: int, tokens: Tokens) -> torch.Tensor | None:
        """The entry ``put_once`` stored under ``key`` (None when it is gone or holds other ``tokens``), removed."""
        data = self._read(key, tokens)
        self._remove(key)
        return None if data is None else self._decode(data)

    def close(self) -> None:
        """The engine is done with this tier. Default: nothing to release."""

    # -- bookkeeping -----------------------------------------------------------------------------------------
    def _next_slot(self) -> int:
        self._slots += 1
        return self._slots

    def _add(self, key: int, entry: _Entry) -> None:
        self._entries[key] = entry
        self.used_bytes += entry.num_bytes
        if not entry.pinned:
            self._tracker.cached(entry.slot)
            self._tracker.release(entry.slot)
            self._key_of_slot[entry.slot] = key

    def _adopt_entry(self, key: int) -> bool:
        num_bytes = self._adopt(key)
        if num_bytes is None:
            return False
        while self.used_bytes + num_bytes > self.capacity and self._tracker.num_evictable():
            self._evict_one()
        self._add(key, _Entry(self._next_slot(), None, num_bytes, False))
        return True

    def _pinned_bytes(self) -> int:
        return sum(e.num_bytes for e in self._entries.values() if e.pinned)

    def _evict_one(self) -> None:
        slot = self._tracker.victim()
        key = self._key_of_slot[slot]
        entry = self._entries[key]
        if self.on_evict is not None and entry.tokens is not None:
            data = self._read(key, entry.tokens)
            if data is not None:
                self.on_evict(key, entry.tokens, self._decode(data))
        self._drop(key)

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.used_bytes -= entry.num_bytes
        if not entry.pinned:
            self._tracker.forget(entry.slot)
            del self._key_of_slot[entry.slot]
        self._remove(key)

    def _encode(self, data: torch.Tensor) -> torch.Tensor:
        if self.kv_dtype == "int8" and data.is_floating_point():
            # A meta tensor quantizes to a meta tensor of the packed shape: the bytes an 8-bit entry takes.
            return quantize(data if data.is_meta else data.cpu(), FORMATS["int8"])
        if data.is_meta:   # payload-free (simulated): nothing to copy
            return data
        return data.detach().to("cpu", copy=True).contiguous()

    def _decode(self, data: torch.Tensor) -> torch.Tensor:
        fmt = format_of_cache(data)
        if fmt is not None and self.context.dtype != data.dtype:   # stored 8-bit below a model-dtype pool
            return dequantize(data, fmt).to(self.context.dtype)
        return data


KV_TIERS: Registry[KVTier] = Registry("kv tier", base=KVTier, builtin_packages=("nanovllm.kv_tiers",),
                                      engine_args=("context",))


def register_kv_tier(name: str) -> Callable[[type[KVTier]], type[KVTier]]:
    """Class decorator registering a ``KVTier`` subclass under ``name`` (``kv_offload=<name>``)."""
    return KV_TIERS.register(name)
