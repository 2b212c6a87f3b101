"""KV tiers in the engine: a stack of ``KVTier`` (top first: ``host`` then ``disk``) below the primary pool, an
``OffloadPolicy`` deciding what moves, and the copies between them.

* Down: the allocator tells of each cached block it evicts (``on_evicted``), the scheduler of each request
  whose prompt is computed (``on_tokens_computed``); the policy says whether its blocks go to the top tier. A
  tier evicting an entry hands it to the next tier when the policy demotes it.
* Up: at admission, after the primary pool's prefix match, ``plan`` counts the next blocks some tier holds
  (the longest cached prefix spans every tier) and ``load`` copies them into the request's fresh blocks: they
  are loaded, not recomputed. A block that fails to load (missing file, checksum, a full tier dropped it) ends
  the load there: those tokens are computed, and one line is logged.
* Swap: a preempted request's computed blocks go to the top tier as one pinned entry (``swap_out``); at its
  readmission they are loaded back and it resumes where it stopped. A full tier means recompute.
* Prefetch: the policy's ``prefetch`` head-of-queue requests get their blocks in lower tiers promoted to the
  top tier at the start of a step (``prefetch``).

Counters per tier (hit tokens, blocks written and loaded, bytes moved, failures) and swapped tokens feed the
step record (``take_step_stats``).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from nanovllm.allocator import EvictedBlock, prefix_block_keys
from nanovllm.eviction import EVICTION_POLICIES
from nanovllm.kv_tiers import KV_TIERS, KVTier, TierContext, Tokens
from nanovllm.kv_tiers.offload import OFFLOAD_POLICIES, OffloadPolicy
from nanovllm.registry import UnknownPluginError
from nanovllm.request import Request

logger = logging.getLogger(__name__)

PREEMPTION_MODES = ("recompute", "swap")
_SPEC_KEYS = ("policy", "below")   # kv_offload options that are the stack's, not the tier's


class CachedPrefix(int):
    """How many tokens of a request are cached (an int, what ``cached_prefix_len`` always returned), with
    ``by_tier``: how many of them each level holds, ``primary`` first, then each tier by name."""

    by_tier: dict[str, int]

    def __new__(cls, by_tier: dict[str, int]) -> "CachedPrefix":
        value = super().__new__(cls, sum(by_tier.values()))
        value.by_tier = by_tier
        return value


@dataclass
class TierStats:
    """What moved through one tier (cumulative)."""

    hit_tokens: int = 0        # prompt tokens loaded from it at admission instead of computed
    blocks_written: int = 0
    blocks_loaded: int = 0     # admissions, swap-ins and promotions
    bytes_written: int = 0
    bytes_loaded: int = 0
    failures: int = 0          # blocks it could not store or return (full, missing, corrupt)
    # Time spent loading blocks out of it (wall: reading them, and at admission their copy into the pool;
    # simulated: its link's share for what it read).
    load_seconds: float = 0.0
    # Time spent writing blocks into it (wall: reading them out of the pool, or out of the tier above for a
    # demotion, and storing them; simulated: its link's share for what it wrote). With ``load_seconds``, what a
    # calibration fits the tier's link from (``nanovllm.harness.sim.calibrate.fit_tier_links``).
    write_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class Load:
    """A planned load for one admission: per block from ``first_block``, the tier index holding it; or a swap."""

    first_block: int
    tiers: list[int] = field(default_factory=list)
    swap: bool = False
    swap_tokens: int = 0


def _check_tier_values(node: Mapping[str, Any], where: str) -> None:
    """The options every built-in tier takes, checked by value before anything is built, so a bad one is an
    error naming its field (``where``: ``kv_offload``, ``kv_offload.below``, ...) at config time."""
    capacity = node.get("capacity", 1)
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"{where}.capacity must be a number of bytes >= 1, got {capacity!r}")
    if node.get("eviction", "lru") not in EVICTION_POLICIES:
        raise ValueError(f"{where}.eviction must be one of {', '.join(EVICTION_POLICIES.names())}, "
                         f"got {node['eviction']!r}")
    if node.get("kv_dtype", "auto") not in ("auto", "int8"):
        raise ValueError(f"{where}.kv_dtype must be auto or int8, got {node['kv_dtype']!r}")


def check_kv_offload(spec: Any) -> list[dict[str, Any]] | None:
    """``kv_offload`` as a list of tier specs (top first), each ``{"name", **options}`` with ``policy`` kept on
    the first; None when off. Raises ``ValueError`` naming what is wrong (``LLM(...)`` and Hydra both check)."""
    if spec is None or spec == "none" or (isinstance(spec, Mapping) and spec.get("name") in (None, "none")):
        return None
    chain: list[dict[str, Any]] = []
    node: Any = spec
    while node is not None:
        if isinstance(node, str):
            node = {"name": node}
        if not isinstance(node, Mapping):
            raise ValueError(f"kv_offload must be a tier name or a mapping {{name: ..., **options}}, got {node!r}")
        node = dict(node)
        below = node.pop("below", None)
        policy = node.pop("policy", None)
        if policy is not None and chain:
            raise ValueError("kv_offload: give the offload policy on the top tier, not on a tier below it")
        KV_TIERS.check(node, "kv_offload")
        try:
            OFFLOAD_POLICIES.check(policy if policy is not None else "evict", "kv_offload.policy")
        except UnknownPluginError as exc:  # a bare name's error says what is registered, not which field
            raise ValueError(f"kv_offload.policy: {exc}") from exc
        _check_tier_values(node, "kv_offload" + ".below" * len(chain))
        chain.append({**node, "policy": policy} if not chain else node)
        node = below
    return chain


def tier_names(names: Sequence[str]) -> list[str]:
    """The names a stack's tiers go by in step records and metrics (top first): each tier's registered name,
    with its position appended where two tiers of the stack share one (``host0``, ``host1``)."""
    return [name if list(names).count(name) == 1 else f"{name}{index}" for index, name in enumerate(names)]


def tier_capacities(spec: Any) -> dict[str, int | None]:
    """Each tier of ``spec`` (a ``kv_offload`` value) by its record name (``tier_names``), with the capacity in
    bytes the spec states (None where it leaves the tier's default); empty when off. The live dashboard reads
    it from a run's config to draw each tier's occupancy as a fraction of its capacity."""
    chain = check_kv_offload(spec) or []
    names = tier_names([str(node["name"]) for node in chain])
    return {name: node.get("capacity") for name, node in zip(names, chain)}


def with_shared_store(spec: Any, store: str) -> Any:
    """``spec`` with every ``shared`` tier that names no ``store`` given ``store``: a simulated cluster gives
    each run a store of its own, so runs in one process never see each other's blocks."""
    if isinstance(spec, str):
        return {"name": spec, "store": store} if spec == "shared" else spec
    if not isinstance(spec, Mapping):
        return spec
    node = dict(spec)
    if node.get("name") == "shared":
        node.setdefault("store", store)
    if node.get("below") is not None:
        node["below"] = with_shared_store(node["below"], store)
    return node


def kv_namespace(*geometry: Any) -> str:
    """A short fingerprint of the model and K/V geometry: a disk tier's subdirectory."""
    return hashlib.sha256("|".join(map(str, geometry)).encode()).hexdigest()[:16]


class KVOffload:
    """The tier stack of one engine (see the module docstring). ``read_blocks(ids)`` returns the K/V of
    primary-pool blocks ``[layers, 2, n, ...]``; ``write_blocks(ids, data)`` writes them back."""

    def __init__(self, spec: Any, context: TierContext, block_size: int,
                 read_blocks: Callable[[list[int]], torch.Tensor],
                 write_blocks: Callable[[list[int], torch.Tensor], None]) -> None:
        chain = check_kv_offload(spec)
        if chain is None:
            raise ValueError("KVOffload needs a kv_offload spec")
        policy = chain[0].pop("policy")
        self.policy: OffloadPolicy = OFFLOAD_POLICIES.build(policy if policy is not None else "evict")
        self.tiers: list[KVTier] = [KV_TIERS.build(node, context) for node in chain]
        self.names = tier_names([tier.name for tier in self.tiers])
        for i, tier in enumerate(self.tiers[:-1]):
            tier.on_evict = self._demoter(i)
        self.block_size = block_size
        self._read, self._write = read_blocks, write_blocks
        self.stats = {name: TierStats() for name in self.names}
        self.swapped_tokens = 0
        self._seen: dict[str, dict[str, float]] = {name: TierStats().as_dict() for name in self.names}
        self._swapped_seen = 0
        self._written_through: set[str] = set()
        self._swap_keys: dict[str, tuple[int, int]] = {}   # request_id -> (swap key, tokens)
        self._swap_ids = itertools.count(1)
        # Write seconds counted so far, every tier: a put that demotes into the tier below (inside the upper
        # tier's put) takes that demotion's time out of its own, so no second of writing is counted twice.
        self._write_seconds_counted = 0.0

    def _count_write_seconds(self, index: int, since: float, nested_before: float) -> None:
        """Tier ``index`` wrote from ``since`` (perf_counter) until now, less what nested writes counted since
        ``nested_before`` (``_write_seconds_counted`` then)."""
        own = time.perf_counter() - since - (self._write_seconds_counted - nested_before)
        self.stats[self.names[index]].write_seconds += own
        self._write_seconds_counted += own

    def _read_down(self, index: int, block_ids: list[int]) -> torch.Tensor:
        """The pool's blocks ``block_ids``, read to be written into tier ``index``: the read is part of that
        write's time (payload-free tiers: none; the simulated runner charges their link)."""
        start, nested = time.perf_counter(), self._write_seconds_counted
        data = self._read(block_ids)
        if not data.is_meta:
            self._count_write_seconds(index, start, nested)
        return data

    # -- down --------------------------------------------------------------------------------------------------
    def _put(self, index: int, key: int, tokens: Tokens, data: torch.Tensor, pinned: bool = False) -> bool:
        tier, stats = self.tiers[index], self.stats[self.names[index]]
        start, nested = time.perf_counter(), self._write_seconds_counted
        stored = tier.put(key, tokens, data, pinned)
        if not data.is_meta:
            self._count_write_seconds(index, start, nested)
        if stored:
            stats.blocks_written += data.shape[2]
            stats.bytes_written += data.numel() * data.element_size()
            return True
        stats.failures += 1
        return False

    def _demoter(self, index: int) -> Callable[[int, Tokens, torch.Tensor], None]:
        def demote(key: int, tokens: Tokens, data: torch.Tensor) -> None:
            if self.policy.demote(self.names[index], key):
                self._put(index + 1, key, tokens, data)
        return demote

    def on_evicted(self, block: EvictedBlock) -> None:
        """The allocator evicts ``block``: copy it down if the policy says so and no tier has it yet."""
        if self._tier_of(block.key) is None and self.policy.on_evict(block):
            self._put(0, block.key, block.tokens, self._read_down(0, [block.block]))

    def on_tokens_computed(self, request: Request) -> None:
        """``request`` advanced: once its prompt is computed, write its full prompt blocks through if asked."""
        if request.num_computed_tokens < request.num_prompt_tokens or request.request_id in self._written_through:
            return
        self._written_through.add(request.request_id)
        if not self.policy.on_prefill(request):
            return
        keys = prefix_block_keys(request.prompt_token_ids, self.block_size)
        missing = [i for i, key in enumerate(keys) if self._tier_of(key) is None]
        if not missing:
            return
        data = self._read_down(0, [request.block_table[i] for i in missing])
        for j, i in enumerate(missing):
            self._put(0, keys[i], self._tokens(request, i), data[:, :, j:j + 1])

    def swap_out(self, request: Request) -> bool:
        """Preemption by swap: ``request``'s computed blocks go to the top tier, pinned. False (recompute) when
        it has nothing computed or the tier cannot hold them."""
        num_tokens = request.num_computed_tokens
        num_blocks = -(-num_tokens // self.block_size)
        if num_tokens == 0 or num_blocks > len(request.block_table):
            return False
        key = hash(("swap", request.request_id, next(self._swap_ids)))   # tokens are checked on load too
        data = self._read_down(0, request.block_table[:num_blocks])
        if not self._put(0, key, tuple(request.token_ids[:num_tokens]), data, pinned=True):
            logger.warning("kv tiers: %s cannot hold request %s's %d blocks; preempting it by recompute",
                           self.names[0], request.request_id, num_blocks)
            return False
        self._swap_keys[request.request_id] = (key, num_tokens)
        return True

    def forget(self, request: Request) -> None:
        """``request`` ended (aborted, rejected, finished): drop its swapped blocks and its bookkeeping."""
        swapped = self._swap_keys.pop(request.request_id, None)
        if swapped is not None:
            self.tiers[0].discard(swapped[0])
        self._written_through.discard(request.request_id)

    # -- up ----------------------------------------------------------------------------------------------------
    def _get(self, index: int, key: int, tokens: Tokens | None) -> torch.Tensor | None:
        """``tiers[index].get``, its wall time counted as that tier's load time (payload-free tiers cost
        nothing here: the simulated runner charges their link's time instead)."""
        start = time.perf_counter()
        data = self.tiers[index].get(key, tokens)
        if data is not None and not data.is_meta:
            self.stats[self.names[index]].load_seconds += time.perf_counter() - start
        return data

    def _tier_of(self, key: int) -> int | None:
        return next((i for i, tier in enumerate(self.tiers) if tier.contains(key)), None)

    def _tokens(self, request: Request, index: int) -> Tokens:
        return tuple(request.token_ids[index * self.block_size:(index + 1) * self.block_size])

    def _below(self, request: Request, first_block: int) -> list[int]:
        """The tier index of each block after ``first_block`` that some tier holds, up to the first gap."""
        found = []
        for key in prefix_block_keys(request.token_ids, self.block_size)[first_block:]:
            index = self._tier_of(key)
            if index is None:
                break
            found.append(index)
        return found

    def cached_prefix_len(self, request: Request, primary_tokens: int) -> CachedPrefix:
        """How many of ``request``'s tokens are cached: ``primary_tokens`` in the primary pool, then the longest
        run of next blocks across the tiers, split by where each block is (a pure lookup)."""
        by_tier = {"primary": primary_tokens, **{name: 0 for name in self.names}}
        for index in self._below(request, primary_tokens // self.block_size):
            by_tier[self.names[index]] += self.block_size
        return CachedPrefix(by_tier)

    def plan(self, request: Request, cached_tokens: int) -> Load:
        """What admission can load for ``request`` after ``cached_tokens`` matched in the primary pool: its
        swapped blocks, else the blocks the tiers hold. Reads nothing."""
        first = cached_tokens // self.block_size
        swapped = self._swap_keys.get(request.request_id)
        if swapped is not None:
            return Load(first, swap=True, swap_tokens=max(0, swapped[1] - cached_tokens))
        return Load(first, tiers=self._below(request, first))

    def planned_tokens(self, load: Load) -> int:
        """Tokens ``load`` would cover."""
        return load.swap_tokens if load.swap else len(load.tiers) * self.block_size

    def load(self, request: Request, load: Load) -> CachedPrefix:
        """Copy the planned blocks into ``request.block_table[load.first_block:]`` (allocated by now); return
        how many tokens were loaded, split by the tier each came from (a swap-in: none split). A block that
        cannot be read ends the load there (computed instead)."""
        if load.swap:
            return CachedPrefix({self.names[0]: self._swap_in(request, load)})
        keys = prefix_block_keys(request.token_ids, self.block_size)
        by_tier = {name: 0 for name in self.names}
        j = 0
        while j < len(load.tiers):
            i = load.first_block + j
            # Looked up again: the allocation that made room may have pushed it a tier down since the plan.
            index = self._tier_of(keys[i])
            if index is None:
                self._load_failed(request, i, load.tiers[j])
                break
            # The run of next blocks this tier holds, read in one call and copied in as few pieces as it gives.
            run = [i]
            while j + len(run) < len(load.tiers) and self._tier_of(keys[i + len(run)]) == index:
                run.append(i + len(run))
            loaded = self._load_run(index, request, [(keys[b], b) for b in run])
            by_tier[self.names[index]] += loaded * self.block_size
            j += loaded
            if loaded < len(run):
                self._load_failed(request, i + loaded, index)
                break
        return CachedPrefix(by_tier)

    def _load_run(self, index: int, request: Request, run: list[tuple[int, int]]) -> int:
        """Copy ``request``'s blocks ``run`` ((key, block index), consecutive) from tier ``index`` into its block
        table; return how many of them, from the first, the tier had. Its wall time (reading them out of the tier
        and copying them into the pool) is the tier's load time; payload-free tiers cost nothing here (the
        simulated runner charges their link's time)."""
        blocks = [(key, self._tokens(request, i)) for key, i in run]
        start = time.perf_counter()
        pieces = self.tiers[index].get_many(blocks)
        loaded = 0
        for piece in pieces:
            first = run[0][1] + loaded
            # Each piece goes in as it came: the pool's write copies it per (layer, K/V) in runs of consecutive
            # pool blocks, so a piece is copied once; concatenating the pieces first would copy every byte twice.
            self._write(request.block_table[first:first + piece.shape[2]], piece)
            loaded += piece.shape[2]
        stats = self.stats[self.names[index]]
        if pieces and not pieces[0].is_meta:
            stats.load_seconds += time.perf_counter() - start
        stats.blocks_loaded += loaded
        stats.hit_tokens += loaded * self.block_size
        stats.bytes_loaded += sum(piece.numel() * piece.element_size() for piece in pieces)
        return loaded

    def _load_failed(self, request: Request, block: int, index: int) -> None:
        self.stats[self.names[index]].failures += 1
        logger.warning("kv tiers: block %d of request %s is gone from %s; recomputing from there", block,
                       request.request_id, self.names[index])

    def _swap_in(self, request: Request, load: Load) -> int:
        key, num_tokens = self._swap_keys.pop(request.request_id)
        tier, stats = self.tiers[0], self.stats[self.names[0]]
        if not load.swap_tokens:   # the primary pool's prefix match already covers what was swapped
            tier.discard(key)
            return 0
        start = time.perf_counter()
        data = tier.get(key, tuple(request.token_ids[:num_tokens]))
        if data is None:
            tier.discard(key)
            stats.failures += 1
            logger.warning("kv tiers: request %s's swapped blocks are gone; recomputing it", request.request_id)
            return 0
        last = -(-num_tokens // self.block_size)
        # Written before the discard: ``data`` may be a view of the tier's storage, which the discard frees.
        self._write(request.block_table[load.first_block:last], data[:, :, load.first_block:last])
        if not data.is_meta:   # reading it and copying it into the pool, as for a load at admission
            stats.load_seconds += time.perf_counter() - start
        tier.discard(key)
        stats.blocks_loaded += last - load.first_block
        stats.bytes_loaded += data[:, :, load.first_block:].numel() * data.element_size()
        self.swapped_tokens += load.swap_tokens
        return load.swap_tokens

    def prefetch(self, waiting: Iterable[Request]) -> None:
        """Promote the blocks of the first ``policy.prefetch`` waiting requests from lower tiers to the top."""
        if not self.policy.prefetch or len(self.tiers) < 2:
            return
        for request in itertools.islice(waiting, self.policy.prefetch):
            if request.request_id in self._swap_keys or not self.policy.should_prefetch(request):
                continue
            keys = prefix_block_keys(request.token_ids, self.block_size)
            for i, index in enumerate(self._below(request, 0)):
                if index == 0:
                    continue
                data = self._get(index, keys[i], self._tokens(request, i))
                if data is None:
                    self.stats[self.names[index]].failures += 1
                    break
                stats = self.stats[self.names[index]]
                stats.blocks_loaded += 1
                stats.bytes_loaded += data.numel() * data.element_size()
                self._put(0, keys[i], self._tokens(request, i), data)

    # -- blocks handed between replicas (``kv_transfer=shared_store``) -------------------------------------------
    def tier_index(self, name: str) -> int | None:
        """The position of the tier registered as ``name`` in this stack (None: there is none)."""
        return next((i for i, tier in enumerate(self.tiers) if tier.name == name), None)

    def put_blocks(self, index: int, blocks: list[tuple[int, Tokens]], data: torch.Tensor) -> int:
        """Store block ``j`` of ``data`` ([layers, 2, n, ...]) under ``blocks[j]`` (key, tokens) in tier ``index``,
        skipping those it holds already (a write-through put them there); returns the bytes written. A prefill
        replica hands its prompt's full blocks to the shared store this way."""
        tier, written = self.tiers[index], 0
        for j, (key, tokens) in enumerate(blocks):
            if tier.contains(key):
                continue
            block = data[:, :, j:j + 1]
            if self._put(index, key, tokens, block):
                written += block.numel() * block.element_size()
        return written

    def put_once(self, index: int, key: int, tokens: Tokens, data: torch.Tensor) -> None:
        """``KVTier.put_once`` on tier ``index``, counted as a write (a prompt's partial last block handed to a
        decode replica); raises ``OSError`` when the storage fails."""
        self.tiers[index].put_once(key, tokens, data)
        stats = self.stats[self.names[index]]
        stats.blocks_written += data.shape[2]
        stats.bytes_written += data.numel() * data.element_size()

    def take_once(self, index: int, key: int, tokens: Tokens) -> torch.Tensor | None:
        """``KVTier.take`` on tier ``index``, counted as a load."""
        start = time.perf_counter()
        data = self.tiers[index].take(key, tokens)
        if data is not None:
            stats = self.stats[self.names[index]]
            stats.load_seconds += time.perf_counter() - start
            stats.blocks_loaded += data.shape[2]
            stats.bytes_loaded += data.numel() * data.element_size()
        return data

    def get_blocks(self, index: int, blocks: list[tuple[int, Tokens]]) -> list[torch.Tensor]:
        """The blocks (key, tokens) tier ``index`` holds, in order, up to the first it does not (counted as loads,
        not prefix hits: a decode replica receiving a prefill's K/V through the shared store)."""
        found = []
        stats = self.stats[self.names[index]]
        for key, tokens in blocks:
            data = self._get(index, key, tokens)
            if data is None:
                break
            stats.blocks_loaded += 1
            stats.bytes_loaded += data.numel() * data.element_size()
            found.append(data)
        return found

    # -- records -----------------------------------------------------------------------------------------------
    def capacities(self) -> dict[str, int]:
        """Each tier's capacity in bytes, by record name (what the live views draw occupancy against)."""
        return {name: tier.capacity for name, tier in zip(self.names, self.tiers)}

    def take_step_stats(self) -> tuple[int, dict[str, dict[str, float]]]:
        """(swapped tokens, per tier counters plus ``blocks`` and ``bytes`` held) since the last call."""
        per_tier = {}
        for name, tier in zip(self.names, self.tiers):
            now = self.stats[name].as_dict()
            per_tier[name] = {k: v - self._seen[name][k] for k, v in now.items()}
            per_tier[name].update(blocks=tier.num_entries(), bytes=tier.used_bytes)
            self._seen[name] = now
        swapped, self._swapped_seen = self.swapped_tokens - self._swapped_seen, self.swapped_tokens
        return swapped, per_tier

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
