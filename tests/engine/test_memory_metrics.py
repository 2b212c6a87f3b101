"""The memory metrics: prefix-cache hit tokens, evictions, tokens recomputed after preemption, internal
fragmentation and cached-but-unreferenced blocks, per step (StepRecord) and per run (summarize)."""

from __future__ import annotations

from helpers import bare_scheduler, drive, make_request
from nanovllm import LLM, SamplingParams
from nanovllm.serving.metrics import summarize
from nanovllm.serving.records import request_record


def _early_and_late(allocator: str = "paged"):
    """6 blocks of 4: two 8-token prompts growing to 16 tokens cannot both fit; the later one is preempted."""
    early, late = make_request("early", 8, 8), make_request("late", 8, 8, arrival=1.0, start=11)
    bare = bare_scheduler("fcfs", allocator, num_blocks=6, block_size=4, max_num_seqs=4)
    for r in (early, late):
        bare.add(r, 0.0)
    drive(bare)
    return early, late


def test_tokens_recomputed_after_preemption_are_counted_per_request():
    early, late = _early_and_late()
    assert late.num_preemptions >= 1 and early.num_recomputed_tokens == 0
    # Everything `late` had computed before its (last) preemption was computed again, nothing else.
    assert 8 <= late.num_recomputed_tokens < late.num_tokens * late.num_preemptions + 1
    assert late.max_computed_tokens == late.num_tokens - 1   # the newest token is never computed
    records = [request_record(r, 0.0) for r in (early, late)]
    assert summarize(records)["recomputed_tokens"] == late.num_recomputed_tokens


def test_a_prefix_cache_hit_is_not_recompute():
    # With a prefix cache, the preempted request's prompt blocks survive in the cache: re-admission hits them.
    _, late = _early_and_late("prefix")
    assert late.num_preemptions >= 1
    assert late.num_recomputed_tokens <= late.max_computed_tokens - late.num_cached_tokens


def _summary_of_steps(steps):
    return summarize([], steps)


def test_run_summary_adds_up_the_step_memory_fields():
    steps = [dict(kv_blocks_used=4, kv_blocks_total=8, kv_blocks_cached=c, duration=0.1, num_evictions=e,
                  kv_slots_unused=u, prefix_hit_tokens=0, recomputed_tokens=0)
             for c, e, u in ((0, 0, 3), (2, 1, 5), (4, 2, 1))]
    summary = _summary_of_steps(steps)
    assert summary["num_evictions"] == 3
    assert summary["mean_kv_slots_unused"] == 3.0
    assert summary["mean_kv_blocks_cached"] == 2.0
    # Runs recorded before these fields existed report None, not a misleading 0.
    old = [{k: v for k, v in s.items() if k not in ("num_evictions", "kv_slots_unused")} for s in steps]
    assert _summary_of_steps(old)["num_evictions"] is None


def test_engine_step_records_carry_the_memory_fields(llm):
    engine = LLM(allocator={"name": "radix", "eviction": "lfu"}, num_kv_blocks=48, block_size=8,
                 max_model_len=512).engine
    prompt = llm.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe, please."}])
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = engine.make_request(prompt, params, request_id="first")
    engine.add_request(first)
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step().record)
    second = engine.make_request(prompt, params, request_id="second")
    engine.add_request(second)
    while engine.has_unfinished():
        steps.append(engine.step().record)
    hits = sum(s["prefix_hit_tokens"] for s in steps)
    assert hits == second.num_cached_tokens > 0 and first.num_cached_tokens == 0
    assert all(0 <= s["kv_slots_unused"] < 8 for s in steps)   # one partly filled block per request at most
    assert steps[-1]["kv_blocks_cached"] > 0 and sum(s["num_evictions"] for s in steps) == 0
    assert all(s["recomputed_tokens"] == 0 for s in steps)
