"""KV tiers below the pool: the tiers alone (capacity, eviction, 8-bit storage, the disk tier's checksums,
restarts and sharing), then engines on the real model: each offload policy's defining effect in counted blocks
or hit tokens, prefix lookup across tiers, swap preemption, and faults falling back to recompute."""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.kv_offload import check_kv_offload
from nanovllm.kv_tiers import KV_TIERS, TierContext
from nanovllm.kv_tiers.offload import OFFLOAD_POLICIES

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
