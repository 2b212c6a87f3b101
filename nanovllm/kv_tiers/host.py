"""``host``: a second pool of K/V blocks in this process's memory (CPU RAM), bounded in bytes.

Blocks live in slabs laid out as the primary pool is, ``[layers, 2, slots, *block]`` in the stored dtype (the
cache's, or packed 8-bit rows with ``kv_dtype=int8``): an entry of ``n`` blocks holds ``n`` slots, and a freed
slot goes back to a free list and is reused. Slabs are added in chunks as entries arrive, never past what
``capacity`` can hold, so a tier with the default 1 GiB costs nothing until blocks come. Blocks in consecutive
slots of one chunk read out as one view (``get_many``), which the pool's write copies in straight, without a
gather first. Free slots are taken highest first: the pool evicts a request's blocks last first, so a prefix's
blocks land in ascending slots.

Anything that does not fit the slabs' geometry (the first slab entry sets it: layers, K/V, block shape, dtype)
is kept as a tensor of its own, as are the payload-free mode's ``meta`` tensors (``runner=sim``: nothing is
allocated) and ``put_once`` entries (outside capacity, so outside the slabs' bound).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from nanovllm.kv_tiers import KVTier, TierContext, Tokens, register_kv_tier

CHUNK_BYTES = 64 << 20   # the slab storage one growth step adds (less where the capacity left is smaller)


@register_kv_tier("host")
class HostTier(KVTier):
    """Blocks in slab storage (see the module docstring). ``capacity`` bytes (default 1 GiB), ``eviction``
    ``lru`` | ``lfu`` | ``fifo``, ``kv_dtype`` ``auto`` | ``int8``."""

    def __init__(self, context: TierContext, capacity: int = 1 << 30, eviction: str = "lru",
                 kv_dtype: str = "auto") -> None:
        super().__init__(context, capacity, eviction, kv_dtype)
        self._chunks: list[torch.Tensor] = []       # each [layers, 2, chunk_slots, *block]
        self._chunk_slots = 0                        # slots per chunk (the last may have fewer)
        self._max_slots = 0                          # what capacity can hold: slots never grow past it
        self._geometry: tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None = None
        self._free: list[int] = []                   # a heap of negated slots: the highest free is taken first
        self._num_slots = 0                          # slots in the chunks so far
        self._placed: dict[int, tuple[Tokens, list[int]]] = {}     # key -> (tokens, its slots in order)
        self._loose: dict[int, tuple[Tokens, torch.Tensor]] = {}   # entries outside the slabs
        self._once: dict[int, tuple[Tokens, torch.Tensor]] = {}    # put_once entries, until taken

    # -- storage -----------------------------------------------------------------------------------------------
    def _write(self, key: int, tokens: Tokens, data: torch.Tensor) -> int:
        num_bytes = data.numel() * data.element_size()
        if data.is_meta or not self._fits_slabs(data):
            self._loose[key] = (tokens, data)
            return num_bytes
        slots = self._take_slots(data.shape[2])
        for j, slot in enumerate(slots):
            chunk, index = divmod(slot, self._chunk_slots)
            self._chunks[chunk][:, :, index].copy_(data[:, :, j])
        self._placed[key] = (tokens, slots)
        return num_bytes

    def _read(self, key: int, tokens: Tokens | None) -> torch.Tensor | None:
        """The stored data under ``key``: a view of the slab for an entry in consecutive slots of one chunk
        (valid until this tier next changes), else a copy gathered from its slots."""
        stored = self._placed.get(key)
        if stored is None:
            loose = self._loose.get(key)
            return None if loose is None or (tokens is not None and loose[0] != tokens) else loose[1]
        if tokens is not None and stored[0] != tokens:
            return None
        runs = self._runs(stored[1])
        return runs[0] if len(runs) == 1 else torch.cat(runs, dim=2)

    def _remove(self, key: int) -> None:
        stored = self._placed.pop(key, None)
        if stored is not None:
            for slot in stored[1]:
                heapq.heappush(self._free, -slot)
        self._loose.pop(key, None)

    # -- batched reads -----------------------------------------------------------------------------------------
    def get_many(self, blocks: Sequence[tuple[int, Tokens | None]]) -> list[torch.Tensor]:
        """``KVTier.get_many`` without a copy: the blocks as views of the slabs, one per run of consecutive slots
        in a chunk (8-bit entries are decoded into a new tensor per run)."""
        pieces: list[torch.Tensor] = []
        run: list[int] = []   # consecutive slots of one chunk, not yet a view

        def flush() -> None:
            if run:
                pieces.append(self._decode(self._view(run[0], len(run))))
                run.clear()

        for key, tokens in blocks:
            stored, entry = self._placed.get(key), self._entries.get(key)
            if stored is None or entry is None or len(stored[1]) != 1:
                flush()   # outside the slabs, missing, or several blocks: the per-block path
                data = self.get(key, tokens)
                if data is None:
                    break
                pieces.append(data)
                continue
            if tokens is not None and stored[0] != tokens:
                flush()
                self._drop(key)   # as ``get`` does: an entry holding other tokens is forgotten
                break
            if not entry.pinned:
                self._tracker.hit(entry.slot)
            slot = stored[1][0]
            if run and (slot != run[-1] + 1 or slot // self._chunk_slots != run[0] // self._chunk_slots):
                flush()
            run.append(slot)
        flush()
        return pieces

    # -- put_once / take: one reader, outside capacity, so outside the slabs -----------------------------------
    def put_once(self, key: int, tokens: Tokens, data: torch.Tensor) -> None:
        """``KVTier.put_once`` (a prompt's partial last block handed to a decode replica): kept as a tensor of its
        own, since it is not counted against capacity and the slabs never grow past it."""
        self._once[key] = (tokens, self._encode(data))

    def take(self, key: int, tokens: Tokens) -> torch.Tensor | None:
        """``KVTier.take``: the ``put_once`` entry under ``key`` (None: gone or other tokens), removed."""
        stored = self._once.pop(key, None)
        if stored is None or stored[0] != tokens:
            return None
        return self._decode(stored[1])

    # -- slabs -------------------------------------------------------------------------------------------------
    def _fits_slabs(self, data: torch.Tensor) -> bool:
        """Whether ``data`` ([layers, 2, n, *block]) has the slabs' geometry; the first such entry sets it."""
        if data.dim() < 3 or data.shape[2] < 1:
            return False
        geometry = (tuple(data.shape[:2]), tuple(data.shape[3:]), data.dtype)
        if self._geometry is None:
            slot_bytes = data[:, :, :1].numel() * data.element_size()
            self._max_slots = self.capacity // slot_bytes
            if self._max_slots < 1:
                return False
            self._geometry = geometry
            self._chunk_slots = max(1, min(CHUNK_BYTES // slot_bytes, self._max_slots))
        return geometry == self._geometry

    def _take_slots(self, n: int) -> list[int]:
        """``n`` free slots, highest first (so blocks stored one after another, last block first, sit side by side
        in block order), adding a chunk when the free list runs short. Capacity in bytes bounds the slots in use,
        so the chunks never grow past ``_max_slots``."""
        while len(self._free) < n:
            if self._num_slots >= self._max_slots:
                raise OSError(f"kv tier host: no free slot for {n} blocks ({self._max_slots} slots, capacity "
                              f"{self.capacity} bytes)")
            self._grow()
        # A swapped entry's blocks in slot order, so they read out as few views as they can.
        return sorted(-heapq.heappop(self._free) for _ in range(n))

    def _grow(self) -> None:
        """Add a chunk of slots (``torch.empty``: the OS backs its pages as they are first written)."""
        assert self._geometry is not None
        lead, block, dtype = self._geometry
        first = self._num_slots
        count = min(self._chunk_slots, self._max_slots - first)
        self._chunks.append(torch.empty(*lead, count, *block, dtype=dtype))
        self._num_slots += count
        for slot in range(first, first + count):
            heapq.heappush(self._free, -slot)

    def _view(self, slot: int, n: int) -> torch.Tensor:
        """Slots ``slot .. slot + n - 1`` (in one chunk) as a view ``[layers, 2, n, *block]``."""
        chunk, index = divmod(slot, self._chunk_slots)
        return self._chunks[chunk][:, :, index:index + n]

    def _runs(self, slots: list[int]) -> list[torch.Tensor]:
        """``slots`` as views, one per run of consecutive slots in one chunk."""
        views: list[torch.Tensor] = []
        start, length = slots[0], 1
        for slot in slots[1:]:
            if slot == start + length and slot // self._chunk_slots == start // self._chunk_slots:
                length += 1
                continue
            views.append(self._view(start, length))
            start, length = slot, 1
        views.append(self._view(start, length))
        return views

    def slab_bytes(self) -> int:
        """Bytes of slab storage allocated so far (at most ``capacity``)."""
        return sum(chunk.numel() * chunk.element_size() for chunk in self._chunks)
