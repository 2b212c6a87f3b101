"""Greedy float32 output must be token-identical to transformers `generate` on the same weights, however the
engine batches, chunks, pages or preempts. This is the test that makes every timing meaningful."""

from __future__ import annotations

import pytest

from nanovllm import LLM, SamplingParams
from tests.conftest import PARITY_MAX_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=PARITY_MAX_TOKENS)


def _run(llm: LLM, prompts):
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.token_ids for o in outputs], llm.last_steps


def _assert_same(ours, reference):
    mismatches = [i for i, (a, b) in enumerate(zip(ours, reference)) if a != b]
    assert not mismatches, f"prompts {mismatches} differ: ours {[ours[i] for i in mismatches]} " \
                           f"vs HF {[reference[i] for i in mismatches]}"
    assert len(ours) == len(reference)


def test_prompts_cover_short_long_and_multi_block(parity_prompts):
    lengths = [len(p) for p in parity_prompts]
    assert len(parity_prompts) >= 16
    assert min(lengths) <= 4 and sum(n > 64 for n in lengths) >= 3


def test_greedy_matches_transformers(llm, parity_prompts, hf_greedy):
    ours, _ = _run(llm, parity_prompts)
    _assert_same(ours, hf_greedy)
    # Some prompts stop on EOS, and then EOS is the last generated id.
    eos = llm.engine.hf_config.eos_token_id
    assert any(o[-1] == eos and len(o) < PARITY_MAX_TOKENS for o in ours)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_parity_across_block_sizes(llm, parity_prompts, hf_greedy, block_size):
    engine = LLM(block_size=block_size, num_kv_blocks=16384 // block_size, max_model_len=1024)
    ours, _ = _run(engine, parity_prompts)
    _assert_same(ours, hf_greedy)


def test_parity_under_repeated_preemption(llm, parity_prompts, hf_greedy):
    # Shortest prompts first, so many requests are admitted together; then a cache that holds the longest
    # request and little more makes their growth preempt (recompute) again and again. Outputs must not change.
    order = sorted(range(len(parity_prompts)), key=lambda i: len(parity_prompts[i]))
    block_size = 4
    num_blocks = -(-(max(map(len, parity_prompts)) + PARITY_MAX_TOKENS) // block_size) + 2
    engine = LLM(block_size=block_size, num_kv_blocks=num_blocks, max_model_len=1024)
    ours, steps = _run(engine, [parity_prompts[i] for i in order])
    _assert_same(ours, [hf_greedy[i] for i in order])
    preemptions = sum(s["num_preempted"] for s in steps)
    assert preemptions >= 5, f"only {preemptions} preemptions"
    assert engine.engine.allocator.num_free_blocks() == num_blocks


def test_parity_with_chunked_prefill(llm, parity_prompts, hf_greedy):
    engine = LLM(max_num_batched_tokens=32, num_kv_blocks=1024, max_model_len=1024)
    ours, steps = _run(engine, parity_prompts)
    _assert_same(ours, hf_greedy)
    assert max(s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps) <= 32
    # Prefill chunks shared steps with decodes.
    assert any(s["num_prefill_tokens"] > 0 and s["num_decode_seqs"] > 0 for s in steps)


def test_parity_with_prefix_cache_and_contiguous_allocators(llm, parity_prompts, hf_greedy):
    # The prefix cache under vLLM's rule (publish=scheduled): the four longest prompts come twice in one batch,
    # and each twin admitted in the first step hits the blocks its original is computing in that very step, so
    # its attention reads K/V written earlier in the same layer. The tokens must not change.
    longest = sorted(range(len(parity_prompts)), key=lambda i: -len(parity_prompts[i]))[:4]
    prefix = LLM(allocator={"name": "prefix", "publish": "scheduled"}, num_kv_blocks=1024, max_model_len=1024)
    ours, steps = _run(prefix, parity_prompts + [parity_prompts[i] for i in longest])
    _assert_same(ours, hf_greedy + [hf_greedy[i] for i in longest])
    block = prefix.engine.allocator.block_size
    assert steps[0]["prefix_hit_tokens"] >= sum((len(parity_prompts[i]) - 1) // block * block for i in longest)
    contiguous = LLM(allocator="contiguous", num_kv_blocks=1024, max_model_len=1024)
    ours, _ = _run(contiguous, parity_prompts + parity_prompts[:4])
    _assert_same(ours, hf_greedy + hf_greedy[:4])
