"""The FlashInfer backend's translation of a step (``AttentionMetadata``) into FlashInfer's paged-KV plan
arguments, checked on CPU: fed those arguments and the paged cache the torch reference backend filled, an
emulation of FlashInfer's documented semantics (tests/kernels/flashinfer_emulation.py) must give the torch backend's
attention output, on random batches of decodes, prefill chunks on cached prefixes and preempted-and-resumed
requests, at block sizes 1, 16 and 64, with and without GQA; and on the real model's own steps."""

from __future__ import annotations

import random

import pytest
import torch

from flashinfer_emulation import batch_paged_attention
from paged_batches import RandomBatches, step_meta
from nanovllm import LLM, SamplingParams
from nanovllm.attention.base import AttentionMetadata
from nanovllm.attention.flashinfer_plan import plan_arguments
from nanovllm.attention.torch_backend import TorchAttention
from nanovllm.engine.kv_cache import allocate_kv_cache


def test_plan_arguments_follow_the_page_table_layout():
    # seq 0: 33 tokens in pages 7, 2, 9 (the last holds 1); seq 1: exactly one full page; seq 2: a decode whose
    # table holds one block more than it needs (allocated ahead), which must not be passed.
    meta = step_meta([5, 16, 1], [33, 16, 20], [[7, 2, 9], [4], [3, 5, 8]], block_size=16)
    plan = plan_arguments(meta)
    assert plan.qo_indptr.tolist() == [0, 5, 21, 22]
    assert plan.kv_indptr.tolist() == [0, 3, 4, 6]
    assert plan.kv_indices.tolist() == [7, 2, 9, 4, 3, 5]
    assert plan.kv_last_page_len.tolist() == [1, 16, 4]
    assert plan.page_size == 16 and not plan.is_decode and plan.batch_size == 3
    for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len):
        assert t.dtype == torch.int32
    assert plan_arguments(step_meta([1, 1], [33, 2], [[7, 2, 9], [4]], 16)).is_decode


def test_a_block_table_shorter_than_its_sequence_is_refused():
    with pytest.raises(ValueError, match="sequence 0: seq_len 33 needs 3 blocks"):
        plan_arguments(AttentionMetadata(query_lens=[1], seq_lens=[33], block_tables=[[7, 2]],
                                         slot_mapping=torch.zeros(1, dtype=torch.long), block_size=16))


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [(6, 2, 16), (4, 4, 8)], ids=["gqa", "mha"])
def test_emulated_flashinfer_matches_the_torch_backend_on_random_batches(block_size, heads):
    num_heads, num_kv_heads, head_dim = heads
    torch.manual_seed(block_size)
    batches = RandomBatches(random.Random(block_size * 7 + num_heads), block_size,
                            num_blocks=8 * (130 // block_size + 2))
    reference = TorchAttention(num_heads, num_kv_heads, head_dim, scale=head_dim ** -0.5)
    _, views = allocate_kv_cache(1, len(batches.free), block_size, num_kv_heads, head_dim, torch.float32,
                                 torch.device("cpu"))
    reference.bind_kv_caches(views)
    k_cache, v_cache = views[0]
    for _ in range(60):
        meta, _ = batches.next_step()
        num_tokens = sum(meta.query_lens)
        q = torch.randn(num_tokens, num_heads, head_dim)
        k, v = torch.randn(2, num_tokens, num_kv_heads, head_dim)
        reference.plan(meta)
        expected = reference.forward(0, q, k, v)  # also writes this step's K/V into the paged cache
        emulated = batch_paged_attention(q, k_cache, v_cache, plan_arguments(meta), sm_scale=head_dim ** -0.5)
        torch.testing.assert_close(emulated.reshape(num_tokens, -1), expected, atol=2e-5, rtol=1e-5)
    assert all(count > 0 for count in batches.seen.values()), batches.seen


class _CheckedAgainstEmulation(TorchAttention):
    """The torch backend, checking every layer call of every step against the emulation on the same cache."""

    def plan(self, meta: AttentionMetadata) -> None:
        super().plan(meta)
        self.fi_plan = plan_arguments(meta)
        self.checked_steps = getattr(self, "checked_steps", 0) + 1

    def forward(self, layer, q, k, v):
        out = super().forward(layer, q, k, v)
        k_cache, v_cache = self.kv_caches[layer]
        emulated = batch_paged_attention(q, k_cache, v_cache, self.fi_plan, sm_scale=self.scale)
        torch.testing.assert_close(emulated.reshape(out.shape), out, atol=1e-4, rtol=1e-4)
        return out


def test_emulated_flashinfer_matches_on_the_models_own_steps(llm, parity_prompts):
    """The real model under chunked prefill and a cache small enough to preempt: every layer of every step."""
    cfg = llm.engine.hf_config
    runner = llm.engine.runner
    backend = _CheckedAgainstEmulation(runner.num_heads, runner.num_kv_heads, runner.head_dim,
                                       runner.head_dim ** -0.5)
    assert cfg.num_attention_heads != cfg.num_key_value_heads  # the default model exercises GQA
    prompts = sorted(parity_prompts, key=len)[:5] + sorted(parity_prompts, key=len)[-1:]
    block_size = 4
    num_blocks = -(-(max(map(len, prompts)) + 6) // block_size) + 2
    # warmup=False: every plan() the backend checks is one of the run's own steps, counted below.
    engine = LLM(attention=backend, block_size=block_size, num_kv_blocks=num_blocks, max_model_len=1024, warmup=False,
                 max_num_batched_tokens=48).engine
    for p in prompts:
        engine.add_request(engine.make_request(p, SamplingParams(temperature=0, max_tokens=6)))
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step().record)
    assert sum(s["num_preempted"] for s in steps) > 0
    assert any(s["num_prefill_seqs"] and s["num_decode_seqs"] for s in steps)
    assert backend.checked_steps == len(steps)
