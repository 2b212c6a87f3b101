"""``shared``: one store of K/V blocks that every replica of a cluster reads and writes, so a prefix computed on
one replica is a hit on another.

Real: the ``disk`` tier's format (checksummed files, atomic renames, per-writer temporary names, adoption of
files other processes wrote) in a directory every replica's process can reach; by default under ``/dev/shm``
(memory-backed shared memory on Linux), so the replicas of one machine (Ray actors are separate processes)
share it at memory speed. Another machine's replicas would need that directory on a shared file system.
Each replica bounds what it writes and adopts to ``capacity``; an entry one replica evicts is gone for all (the
others see a miss and recompute). Before each use an entry is checked to be still there, so a lookup does not
count blocks another replica dropped.

Simulated (payload-free, ``runner=sim``): one in-memory index per ``store`` name and model in this process
(the replicas of a simulated cluster run in one process), with the same bookkeeping; its link is
``hardware.kv_tier_links.shared`` (RDMA or Ethernet). The simulated cluster gives each run a store of its own.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from nanovllm.kv_tiers import TierContext, Tokens, register_kv_tier
from nanovllm.kv_tiers.disk import DiskTier

# Simulated shared stores of this process: (store, namespace) -> key -> (tokens, meta tensor).
_SIMULATED_STORES: dict[tuple[str, str], dict[int, tuple[Tokens, torch.Tensor]]] = {}


@register_kv_tier("shared")
class SharedTier(DiskTier):
    """``path``: the shared directory (default ``/dev/shm/nanovllm-kv-shared``, or the temporary directory where
    there is no ``/dev/shm``); ``store``: the store's name (replicas with the same name share it; a simulated
    cluster sets one per run); ``capacity`` (default 64 GiB), ``eviction``, ``kv_dtype`` as every tier;
    ``persist``: keep this replica's blocks after it closes (default no: the store lives as long as the
    cluster)."""

    def __init__(self, context: TierContext, capacity: int = 64 << 30, eviction: str = "lru",
                 kv_dtype: str = "auto", path: str | None = None, persist: bool = False,
                 store: str = "default") -> None:
        if not isinstance(store, str) or not store or "/" in store:
            raise ValueError(f"kv_offload: shared store must be a non-empty name without '/', got {store!r}")
        self.store = store
        root = Path(path) if path is not None else self.default_root()
        super().__init__(context, capacity, eviction, kv_dtype, path=str(root / store), persist=persist)

    @classmethod
    def default_root(cls) -> Path:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() else Path(tempfile.gettempdir())
        return base / "nanovllm-kv-shared"

    def _ghosts(self) -> dict[int, tuple[Tokens, torch.Tensor]]:
        return _SIMULATED_STORES.setdefault((self.store, self.context.namespace), {})

    def contains(self, key: int) -> bool:
        """Whether ``key`` is in the store now: an entry another replica removed since is forgotten here."""
        if key in self._entries and not self._still_there(key):
            self._drop(key)
            return False
        return super().contains(key)

    def _still_there(self, key: int) -> bool:
        if not self.context.payload:
            return key in self._ghosts()
        return self._file(key).is_file()

    def close(self) -> None:
        super().close()
        store = (self.store, self.context.namespace)
        if self.context.payload or _SIMULATED_STORES.get(store):
            return
        _SIMULATED_STORES.pop(store, None)   # the last replica of a simulated run closed: the store is empty
