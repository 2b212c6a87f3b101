"""The exact standard with KV tiers on: float32 tokens equal transformers' greedy ones when prefixes went to the
host and disk tiers and came back, and when requests were swapped out and in, under chunked prefill and two
block sizes (the session's loaded model is reused; see tests/conftest.py)."""

from __future__ import annotations

import pytest

from nanovllm import LLM, SamplingParams
from conftest import PARITY_MAX_TOKENS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("block_size", [8, 16])
def test_parity_with_host_and_disk_tiers_and_swap(llm, parity_prompts, hf_greedy, block_size, tmp_path):
    num_blocks = 512 // block_size   # a few requests' worth: blocks are evicted, requests preempted
    engine = LLM(block_size=block_size, num_kv_blocks=num_blocks, max_model_len=1024, max_num_batched_tokens=32,
                 allocator="prefix", preemption_mode="swap",
                 kv_offload=dict(name="host", capacity=40 * 2 ** 20,
                                 below=dict(name="disk", path=str(tmp_path), capacity=2 ** 30)))
    greedy = SamplingParams(max_tokens=PARITY_MAX_TOKENS, temperature=0.0)
    for _ in range(2):   # the second pass loads the prefixes the first left in the tiers
        assert [o.token_ids for o in engine.generate(parity_prompts, greedy, use_tqdm=False)] == hf_greedy
    offload = engine.engine.offload
    assert offload.stats["host"].hit_tokens > 0 and offload.stats["disk"].blocks_written > 0
