"""KV tiers below the pool: the tiers alone (capacity, eviction, 8-bit storage, the disk tier's checksums,
restarts and sharing), then engines on the real model: each offload policy's defining effect in counted blocks
or hit tokens, prefix lookup across tiers, swap preemption, and faults falling back to recompute."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.allocator import prefix_block_keys
from nanovllm.engine.kv_offload import KVOffload, check_kv_offload
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.kv_tiers import KV_TIERS, TierContext
from nanovllm.kv_tiers import host as host_module
from nanovllm.kv_tiers.offload import OFFLOAD_POLICIES
from nanovllm.request import Request

CTX = TierContext("test", torch.float32)
BLOCK = torch.arange(2 * 2 * 1 * 4 * 2 * 8, dtype=torch.float32).reshape(2, 2, 1, 4, 2, 8) / 100
BLOCK_BYTES = BLOCK.numel() * 4


def block(i: int) -> torch.Tensor:
    return BLOCK + i


def test_host_tier_stays_within_capacity_and_evicts_in_its_order():
    tier = KV_TIERS.build(dict(name="host", capacity=3 * BLOCK_BYTES, eviction="lru"), CTX)
    for key in range(3):
        assert tier.put(key, (key,), block(key))
    assert torch.equal(tier.get(0, (0,)), block(0))       # 0 is now the most recently used
    assert tier.put(3, (3,), block(3))
    assert tier.used_bytes <= tier.capacity and tier.num_entries() == 3
    assert not tier.contains(1) and tier.contains(0)      # lru dropped 1, not 0
    assert tier.get(2, (99,)) is None                     # other tokens under the key: a miss, never wrong K/V


def test_pinned_entries_are_never_evicted_and_a_full_tier_refuses():
    tier = KV_TIERS.build(dict(name="host", capacity=2 * BLOCK_BYTES), CTX)
    assert tier.put(0, (0,), block(0), pinned=True) and tier.put(1, (1,), block(1), pinned=True)
    assert not tier.put(2, (2,), block(2))
    assert tier.contains(0) and tier.contains(1)


def test_int8_storage_holds_about_twice_the_blocks_and_loads_close_values():
    plain = KV_TIERS.build(dict(name="host", capacity=10 * BLOCK_BYTES), CTX)
    packed = KV_TIERS.build(dict(name="host", capacity=10 * BLOCK_BYTES, kv_dtype="int8"), CTX)
    plain.put(0, (0,), block(0))
    packed.put(0, (0,), block(0))
    assert packed.used_bytes * 1.5 < plain.used_bytes
    loaded = packed.get(0, (0,))
    assert loaded.dtype == torch.float32 and loaded.shape == BLOCK.shape
    assert torch.allclose(loaded, block(0), atol=0.02)


def test_disk_tier_survives_a_restart_and_detects_corruption_and_missing_files(tmp_path):
    spec = dict(name="disk", path=str(tmp_path), capacity=3 * BLOCK_BYTES)
    tier = KV_TIERS.build(spec, CTX)
    for key in range(5):
        tier.put(key, (key,), block(key))
    files = sorted(tier.directory.glob("*.kv"))
    assert len(files) == 3 and tier.used_bytes <= tier.capacity          # bounded
    restarted = KV_TIERS.build(spec, CTX)                                 # a new process on the same directory
    assert restarted.num_entries() == 3 and torch.equal(restarted.get(4, (4,)), block(4))
    raw = bytearray(restarted._file(3).read_bytes())
    raw[-1] ^= 0xFF
    restarted._file(3).write_bytes(bytes(raw))
    assert restarted.get(3, (3,)) is None and not restarted.contains(3)   # checksum: a miss, and forgotten
    restarted._file(2).unlink()
    assert restarted.get(2, (2,)) is None
    other_model = KV_TIERS.build(spec, TierContext("another", torch.float32))
    assert other_model.num_entries() == 0


def test_two_writers_share_a_directory_and_clean_up(tmp_path):
    spec = dict(name="disk", path=str(tmp_path), capacity=4 * BLOCK_BYTES, persist=False)
    a, b = KV_TIERS.build(spec, CTX), KV_TIERS.build(spec, CTX)
    a.put(1, (1,), block(1))
    assert b.contains(1) and torch.equal(b.get(1, (1,)), block(1))       # one writer's block is a hit for the other
    b.put(1, (1,), block(1))
    b.put(2, (2,), block(2))
    assert torch.equal(a.get(2, (2,)), block(2))
    (a.directory / ".tmp-999999999-x").write_bytes(b"torn")               # a dead writer's leftover
    KV_TIERS.build(spec, CTX)
    assert not list(a.directory.glob(".tmp-*"))
    a.close()
    b.close()
    assert not list(a.directory.glob("*.kv"))                              # persist=False: nothing left behind


def test_kv_offload_specs_are_checked_and_stack():
    assert check_kv_offload(None) is None and check_kv_offload("none") is None
    chain = check_kv_offload(dict(name="host", capacity=10, policy=dict(name="reuse", k=3),
                                  below=dict(name="disk", path="/tmp/x")))
    assert [node["name"] for node in chain] == ["host", "disk"]
    with pytest.raises(ValueError, match="kv tier"):
        check_kv_offload("hots")
    with pytest.raises(ValueError, match="does not take"):
        check_kv_offload(dict(name="host", size=3))
    with pytest.raises(ValueError, match="offload policy"):
        check_kv_offload(dict(name="host", policy="sometimes"))
    assert set(OFFLOAD_POLICIES.names()) >= {"evict", "write_through", "reuse"}


def slots_of(tier, key: int) -> list[int]:
    return tier._placed[key][1]


def test_host_slabs_grow_in_chunks_within_capacity_and_reuse_freed_slots(monkeypatch):
    monkeypatch.setattr(host_module, "CHUNK_BYTES", 3 * BLOCK_BYTES)
    tier = KV_TIERS.build(dict(name="host", capacity=10 * BLOCK_BYTES), CTX)
    assert tier.slab_bytes() == 0                                          # nothing until a block comes
    tier.put(0, (0,), block(0))
    assert tier.slab_bytes() == 3 * BLOCK_BYTES                            # one chunk, not the whole capacity
    for key in range(1, 25):                                               # 25 blocks through room for 10
        assert tier.put(key, (key,), block(key))
        assert tier.slab_bytes() <= tier.capacity and tier.used_bytes <= tier.capacity
    assert tier.slab_bytes() == 10 * BLOCK_BYTES and tier.num_entries() == 10   # chunks of 3, 3, 3 and 1
    assert all(torch.equal(tier.get(key, (key,)), block(key)) for key in range(15, 25))
    freed = slots_of(tier, 17) + slots_of(tier, 20)
    tier.discard(17)
    tier.discard(20)
    assert tier.put(100, (100,), block(100)) and tier.put(101, (101,), block(101))
    assert sorted(slots_of(tier, 100) + slots_of(tier, 101)) == sorted(freed)   # reused, no growth
    assert tier.slab_bytes() == 10 * BLOCK_BYTES
    evicted_slot = slots_of(tier, 15)                                        # the least recently used
    assert tier.put(102, (102,), block(102)) and not tier.contains(15)
    assert slots_of(tier, 102) == evicted_slot                               # an evicted entry's slot, reused
    survivors = [16, 18, 19, 21, 22, 23, 24]
    assert all(torch.equal(tier.get(key, (key,)), block(key)) for key in survivors)
    assert all(torch.equal(tier.get(key, (key,)), block(key)) for key in (100, 101, 102))
    default = KV_TIERS.build(dict(name="host"), CTX)                       # 1 GiB: allocates one small chunk
    default.put(0, (0,), block(0))
    assert default.slab_bytes() == 3 * BLOCK_BYTES


def test_host_swapped_entries_span_slots_and_demote_on_eviction(tmp_path):
    tier = KV_TIERS.build(dict(name="host", capacity=4 * BLOCK_BYTES), CTX)
    demoted = []
    tier.on_evict = lambda key, tokens, data: demoted.append((key, data.clone()))
    tier.put(0, (0,), block(0))
    tier.put(1, (1,), block(1))
    tier.discard(0)                                                        # a hole at slot 0
    swapped = torch.cat([block(5), block(6), block(7)], dim=2)
    assert tier.put(9, (5, 6, 7), swapped, pinned=True)                   # slots 0, 2, 3: not one run
    assert torch.equal(tier.get(9, (5, 6, 7)), swapped)
    assert tier.put(2, (2,), block(2))                                     # full: block 1 goes, pinned 9 stays
    assert [key for key, _ in demoted] == [1] and torch.equal(demoted[0][1], block(1))
    assert torch.equal(tier.get(9, (5, 6, 7)), swapped) and torch.equal(tier.get(2, (2,)), block(2))
    tier.put_once(50, (50,), block(50))                                    # outside capacity and the slabs
    assert tier.used_bytes == 4 * BLOCK_BYTES and torch.equal(tier.take(50, (50,)), block(50))
    assert tier.take(50, (50,)) is None


@pytest.mark.parametrize("name", ["host", "disk"])
def test_get_many_reads_a_run_in_order_counts_uses_and_stops_at_the_first_miss(name, tmp_path):
    tier = KV_TIERS.build(dict(name=name, capacity=6 * BLOCK_BYTES, path=str(tmp_path))
                          if name == "disk" else dict(name=name, capacity=6 * BLOCK_BYTES), CTX)
    for key in reversed(range(6)):                                         # last first, as the pool evicts
        tier.put(key, (key,), block(key))
    pieces = tier.get_many([(key, (key,)) for key in (0, 1, 2, 5)])
    assert torch.equal(torch.cat(pieces, dim=2), torch.cat([block(k) for k in (0, 1, 2, 5)], dim=2))
    if name == "host":
        assert len(pieces) == 2                                            # slots 0-2 as one view, then 5
    tier.put(6, (6,), block(6))                                            # full: evicts 4, not 5 (just read)
    assert not tier.contains(4) and all(tier.contains(k) for k in (0, 1, 2, 3, 5))
    pieces = tier.get_many([(0, (0,)), (4, (4,)), (5, (5,))])              # 4 is gone: stops there
    assert len(pieces) == 1 and torch.equal(pieces[0], block(0))
    pieces = tier.get_many([(1, (1,)), (2, (99,)), (5, (5,))])             # other tokens under 2: stops, forgets 2
    assert torch.equal(torch.cat(pieces, dim=2), block(1)) and not tier.contains(2)


def test_host_int8_slabs_hold_packed_rows_and_get_many_decodes_them():
    tier = KV_TIERS.build(dict(name="host", capacity=10 * BLOCK_BYTES, kv_dtype="int8"), CTX)
    for key in reversed(range(4)):
        tier.put(key, (key,), block(key))
    assert tier._chunks[0].dtype == torch.int8 and tier.slab_bytes() <= tier.capacity
    pieces = tier.get_many([(key, (key,)) for key in range(4)])
    assert len(pieces) == 1 and pieces[0].dtype == torch.float32
    assert torch.allclose(pieces[0], torch.cat([block(k) for k in range(4)], dim=2), atol=0.02)


def test_payload_free_host_allocates_nothing_and_keeps_the_bookkeeping():
    ghost = torch.empty(BLOCK.shape, device="meta")
    tier = KV_TIERS.build(dict(name="host", capacity=3 * BLOCK_BYTES), TierContext("sim", torch.float32, False))
    for key in range(5):
        assert tier.put(key, (key,), ghost)
    assert tier.slab_bytes() == 0 and not tier._chunks
    assert tier.num_entries() == 3 and tier.used_bytes == 3 * BLOCK_BYTES
    assert not tier.contains(0) and tier.get(4, (4,)).is_meta
    pieces = tier.get_many([(2, (2,)), (3, (3,)), (4, (4,))])
    assert [piece.is_meta for piece in pieces] == [True] * 3


def test_a_batched_load_fills_the_pool_as_per_block_loads_do(tmp_path):
    def pool_io(pool: torch.Tensor, writes: list[int]):
        runner = SimpleNamespace(_cache=lambda: pool, device=torch.device("cpu"))

        def write(ids: list[int], data: torch.Tensor) -> None:
            writes.append(len(ids))
            ModelRunner.write_kv(runner, ids, data, 0)   # the real runner's write into the pool
        return (lambda ids: pool.index_select(2, torch.tensor(ids))), write

    size = BLOCK.shape[3]
    prompt = [1 + (i * 7) % 50 for i in range(12 * size + 1)]           # 12 full blocks a prefix can match
    keys = prefix_block_keys(prompt, size)
    pool, writes = torch.zeros(2, 2, 24, *BLOCK.shape[3:]), []
    read, write = pool_io(pool, writes)
    offload = KVOffload(dict(name="host", capacity=10 * BLOCK_BYTES,
                             below=dict(name="disk", path=str(tmp_path), capacity=4 * BLOCK_BYTES)),
                        CTX, size, read, write)
    host, disk = offload.tiers

    def tokens(i: int) -> tuple[int, ...]:
        return tuple(prompt[i * size:(i + 1) * size])
    for i in [0, 1, 2, 3, 7, 6, 5, 4, 10, 11]:          # 4-7 last first (as the pool evicts): one run of slots
        host.put(keys[i], tokens(i), block(i))
    host.discard(keys[1])
    host.put(keys[1], tokens(1), block(1))                                 # back in its freed slot
    for i in (8, 9):
        disk.put(keys[i], tokens(i), block(i))
    table = [23, 5, 6, 7, 12, 11, 10, 9, 0, 1, 2, 3, 15]          # pool blocks counting up, down, and jumps
    request = Request("r", prompt, SamplingParams(max_tokens=1), 0.0)
    request.block_table = list(table)
    loaded = offload.load(request, offload.plan(request, 0))
    assert loaded == 12 * size and loaded.by_tier == {"host": 10 * size, "disk": 2 * size}
    assert len(writes) < 12                                                # runs, not a copy per block

    expected, per_block = torch.zeros_like(pool), torch.zeros_like(pool)
    _, write_one = pool_io(per_block, [])
    for i in range(12):
        expected[:, :, table[i]] = block(i)[:, :, 0]
        write_one([table[i]], (host if i not in (8, 9) else disk).get(keys[i], tokens(i)))
    assert torch.equal(pool, expected) and torch.equal(per_block, expected)

    pool.zero_()                                                           # a block gone after the plan
    request.block_table = list(table)
    plan = offload.plan(request, 0)
    host.discard(keys[6])
    assert offload.load(request, plan) == 6 * size
    assert torch.equal(pool[:, :, table[:6]], expected[:, :, table[:6]])
    assert not pool[:, :, table[6:]].any()                                 # the rest is left to compute
    assert offload.stats["host"].failures == 1


def test_each_move_counts_its_seconds_once_to_its_own_tier(tmp_path, monkeypatch):
    """Write time: reading a block out of the pool and storing it count to the tier it goes to; a demotion
    inside the upper tier's put counts to the lower tier only. Load time: reading out and copying in. On a
    clock that advances only where the test says (pool read 1/8 s, host put 1/4 s, disk put 1 s, write into
    the pool 1/2 s), so the sums are exact."""
    from nanovllm.allocator import EvictedBlock
    from nanovllm.engine import kv_offload as kv_offload_module

    now = [0.0]
    monkeypatch.setattr(kv_offload_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def advanced(seconds, call):
        def timed(*args, **kwargs):
            now[0] += seconds
            return call(*args, **kwargs)
        return timed

    size = BLOCK.shape[3]
    prompt = [1 + (i * 7) % 50 for i in range(4 * size + 1)]
    keys = prefix_block_keys(prompt, size)
    pool = torch.stack([block(i)[:, :, 0] for i in range(6)], dim=2)
    writes: list[list[int]] = []
    offload = KVOffload(dict(name="host", capacity=2 * BLOCK_BYTES,
                             below=dict(name="disk", path=str(tmp_path), capacity=64 * BLOCK_BYTES)), CTX, size,
                        advanced(0.125, lambda ids: pool.index_select(2, torch.tensor(ids))),
                        advanced(0.5, lambda ids, data: writes.append(ids)))
    host, disk = offload.tiers
    monkeypatch.setattr(host, "put", advanced(0.25, host.put))
    monkeypatch.setattr(disk, "put", advanced(1.0, disk.put))
    for i in range(4):   # the host tier holds two: the first two evicted go on down to disk
        offload.on_evicted(EvictedBlock(block=i, key=keys[i], tokens=tuple(prompt[i * size:(i + 1) * size]),
                                        uses=1))
    host_stats, disk_stats = offload.stats["host"], offload.stats["disk"]
    assert (host_stats.blocks_written, disk_stats.blocks_written) == (4, 2)
    assert host_stats.write_seconds == 4 * (0.125 + 0.25) and disk_stats.write_seconds == 2 * 1.0
    request = Request("r", prompt, SamplingParams(max_tokens=1), 0.0)
    request.block_table = [10, 11, 12, 13, 14]
    assert offload.load(request, offload.plan(request, 0)) == 4 * size
    # Blocks 0-1 from disk, 2-3 from host, each tier's in as many writes into the pool as its storage gives
    # pieces (reading them out takes no time here): every write's time counted once, to its own tier.
    assert disk_stats.load_seconds >= 0.5 and host_stats.load_seconds >= 0.5
    assert host_stats.load_seconds + disk_stats.load_seconds == 0.5 * len(writes)
    assert host_stats.write_seconds == 4 * (0.125 + 0.25)   # loads write nothing


# -- engines on the real model (float32, the exact path): small caches so blocks move ------------------------

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPTS = [[(7 * i + 13 * j) % 400 + 200 for i in range(64 + 8 * j)] for j in range(5)]


def engine(**options) -> LLM:
    options.setdefault("num_kv_blocks", 14)
    return LLM(max_model_len=256, allocator=options.pop("allocator", "prefix"), max_num_seqs=2, **options)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with LLM(max_model_len=256, num_kv_blocks=256) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def run(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def stats(llm: LLM) -> dict:
    return {name: s.as_dict() for name, s in llm.engine.offload.stats.items()}


@pytest.mark.slow
def test_evict_offloads_only_what_the_pool_evicts_and_loads_it_back(reference):
    big = engine(num_kv_blocks=256, kv_offload="host")
    assert run(big) == reference and stats(big)["host"]["blocks_written"] == 0   # nothing evicted, nothing moved
    small = engine(kv_offload="host")
    assert run(small) == reference
    written = stats(small)["host"]["blocks_written"]
    assert written == small.engine.allocator.num_evictions > 0
    assert run(small) == reference
    assert stats(small)["host"]["hit_tokens"] > 0                                # loaded, not recomputed


@pytest.mark.slow
def test_write_through_writes_every_prompt_block_when_its_prefill_completes(reference):
    llm = engine(num_kv_blocks=256, kv_offload=dict(name="host", policy="write_through"))
    assert run(llm) == reference
    full_blocks = sum((len(p) - 1) // 16 for p in PROMPTS)
    assert stats(llm)["host"]["blocks_written"] == full_blocks and llm.engine.allocator.num_evictions == 0


@pytest.mark.slow
def test_reuse_offloads_only_prefixes_used_k_times(reference):
    once = engine(kv_offload=dict(name="host", policy=dict(name="reuse", k=2)))
    assert run(once) == reference and once.engine.allocator.num_evictions > 0
    assert stats(once)["host"]["blocks_written"] == 0                             # each prompt ran once
    twice = engine(kv_offload=dict(name="host", policy=dict(name="reuse", k=2)))
    run(twice, PROMPTS[:1])
    assert run(twice, PROMPTS) == reference                  # PROMPTS[0] matched: its blocks have 2 uses
    assert 0 < stats(twice)["host"]["blocks_written"] <= (len(PROMPTS[0]) - 1) // 16  # only the reused prompt's


@pytest.mark.slow
def test_prefetch_promotes_disk_blocks_to_host_before_admission(reference, tmp_path):
    disk = dict(name="disk", path=str(tmp_path))
    run(engine(kv_offload=dict(disk, policy="write_through")))     # an earlier engine left the blocks on disk
    for prefetch in (0, 2):
        llm = engine(kv_offload=dict(name="host", policy=dict(name="evict", prefetch=prefetch), below=disk))
        assert run(llm) == reference
        hits = {name: s["hit_tokens"] for name, s in stats(llm).items()}
        if prefetch:
            assert hits["host"] > 0 and hits["disk"] == 0   # promoted before admission, loaded from host
        else:
            assert hits["disk"] > 0 and hits["host"] == 0


@pytest.mark.slow
def test_cached_prefix_len_spans_tiers_and_says_where(reference, tmp_path):
    llm = engine(kv_offload=dict(name="host", policy="write_through"))
    run(llm)
    request = llm.engine.make_request(PROMPTS[0] + [5], GREEDY)
    cached = llm.engine.scheduler.cached_prefix_len(request)
    assert cached == (len(PROMPTS[0]) - 1) // 16 * 16 == sum(cached.by_tier.values())
    assert cached.by_tier["host"] > 0


@pytest.mark.slow
def test_swap_preemption_resumes_without_recompute(reference):
    prompts = PROMPTS[:2]
    expected = reference[:2]
    long = SamplingParams(max_tokens=40, temperature=0.0)
    with LLM(max_model_len=256, num_kv_blocks=256) as ref:
        expected = [o.token_ids for o in ref.generate(prompts, long, use_tqdm=False)]
    recompute = engine(num_kv_blocks=10, kv_offload="host")
    swap = engine(num_kv_blocks=10, kv_offload="host", preemption_mode="swap")
    results = {}
    for name, llm in (("recompute", recompute), ("swap", swap)):
        outs = llm.generate(prompts, long, use_tqdm=False)
        assert [o.token_ids for o in outs] == expected
        results[name] = outs
    assert sum(o.metrics.num_preemptions for o in results["swap"]) > 0
    assert swap.engine.offload.swapped_tokens > 0 and recompute.engine.offload.swapped_tokens == 0
    assert swap.engine.offload.tiers[0]._pinned_bytes() == 0    # swapped entries are gone once resumed


@pytest.mark.slow
def test_a_full_tier_corrupt_or_missing_blocks_fall_back_to_recompute(reference, tmp_path, caplog):
    path = tmp_path / "kv"
    spec = dict(name="disk", path=str(path), policy="write_through")
    first = engine(kv_offload=spec)
    assert run(first) == reference
    files = sorted(first.engine.offload.tiers[0].directory.glob("*.kv"))
    for file in files[::2]:
        raw = bytearray(file.read_bytes())
        raw[-1] ^= 0xFF
        file.write_bytes(bytes(raw))
    for file in files[1::4]:
        file.unlink()
    restarted = engine(kv_offload=spec)            # a new engine on the directory: warm, but damaged
    with caplog.at_level("WARNING"):
        assert run(restarted) == reference
    assert "recomputing" in caplog.text
    full = engine(num_kv_blocks=10, kv_offload=dict(name="host", capacity=1), preemption_mode="swap")
    long = SamplingParams(max_tokens=40, temperature=0.0)
    outs = full.generate(PROMPTS[:2], long, use_tqdm=False)
    assert all(o.finish_reason == "length" for o in outs) and full.engine.offload.swapped_tokens == 0


@pytest.mark.slow
def test_a_shared_store_makes_one_engines_prefix_a_hit_on_another(reference, tmp_path):
    """Two replicas' engines on one shared directory (each its own tier, as in two processes: what one wrote
    the other adopts from the files): the second computes nothing the first wrote through, with the right
    tokens; a block removed behind its back is a miss, recomputed."""
    spec = dict(name="shared", path=str(tmp_path), store="run", policy="write_through")
    first, second = engine(num_kv_blocks=256, kv_offload=spec), engine(num_kv_blocks=256, kv_offload=spec)
    assert run(first, PROMPTS[:2]) == reference[:2]
    assert stats(first)["shared"]["blocks_written"] > 0 and stats(first)["shared"]["hit_tokens"] == 0
    assert run(second, PROMPTS[:2]) == reference[:2]
    full_blocks = sum((len(p) - 1) // 16 for p in PROMPTS[:2])
    assert stats(second)["shared"]["hit_tokens"] == 16 * full_blocks           # every full block: loaded
    for file in (tmp_path / "run").rglob("*.kv"):
        file.unlink()
    third = engine(num_kv_blocks=256, kv_offload=spec)
    assert run(third, PROMPTS[:2]) == reference[:2] and stats(third)["shared"]["hit_tokens"] == 0
    for llm in (first, second, third):
        llm.close()
