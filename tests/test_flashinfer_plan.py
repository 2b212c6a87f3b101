"""The FlashInfer backend's translation of a step (``AttentionMetadata``) into FlashInfer's paged-KV plan
arguments, checked on CPU: fed those arguments and the paged cache the torch reference backend filled, an
emulation of FlashInfer's documented semantics (tests/flashinfer_emulation.py) must give the torch backend's
attention output, on random batches of decodes, prefill chunks on cached prefixes and preempted-and-resumed
requests, at block sizes 1, 16 and 64, with and without GQA; and on the real model's own steps."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from flashinfer_emulation import batch_paged_attention
from nanovllm import LLM, SamplingParams
from nanovllm.attention.base import AttentionMetadata
from nanovllm.attention.flashinfer_plan import plan_arguments
from nanovllm.attention.torch_backend import TorchAttention
from nanovllm.engine.kv_cache import allocate_kv_cache


def _meta(query_lens, seq_lens, tables, block_size) -> AttentionMetadata:
    slots = [table[p // block_size] * block_size + p % block_size
             for q, s, table in zip(query_lens, seq_lens, tables) for p in range(s - q, s)]
    return AttentionMetadata(query_lens=list(query_lens), seq_lens=list(seq_lens), block_tables=tables,
                             slot_mapping=torch.tensor(slots, dtype=torch.long), block_size=block_size)


def test_plan_arguments_follow_the_page_table_layout():
    # seq 0: 33 tokens in pages 7, 2, 9 (the last holds 1); seq 1: exactly one full page; seq 2: a decode whose
    # table holds one block more than it needs (allocated ahead), which must not be passed.
    meta = _meta([5, 16, 1], [33, 16, 20], [[7, 2, 9], [4], [3, 5, 8]], block_size=16)
    plan = plan_arguments(meta)
    assert plan.qo_indptr.tolist() == [0, 5, 21, 22]
    assert plan.kv_indptr.tolist() == [0, 3, 4, 6]
    assert plan.kv_indices.tolist() == [7, 2, 9, 4, 3, 5]
    assert plan.kv_last_page_len.tolist() == [1, 16, 4]
    assert plan.page_size == 16 and not plan.is_decode and plan.batch_size == 3
    for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len):
        assert t.dtype == torch.int32
    assert plan_arguments(_meta([1, 1], [33, 2], [[7, 2, 9], [4]], 16)).is_decode


def test_a_block_table_shorter_than_its_sequence_is_refused():
    with pytest.raises(ValueError, match="sequence 0: seq_len 33 needs 3 blocks"):
        plan_arguments(AttentionMetadata(query_lens=[1], seq_lens=[33], block_tables=[[7, 2]],
                                         slot_mapping=torch.zeros(1, dtype=torch.long), block_size=16))


@dataclass
class _Req:
    num_tokens: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    preempted: bool = False


class _RandomBatches:
    """Requests moving through chunked prefill, decode and preemption (blocks freed, recomputed from scratch
    in new blocks), over a free list in random order so that block tables are never contiguous."""

    def __init__(self, rng: random.Random, block_size: int, num_blocks: int) -> None:
        self.rng, self.block_size = rng, block_size
        self.free = list(range(num_blocks))
        rng.shuffle(self.free)
        self.requests: list[_Req] = []
        self.seen = {"decode_only": 0, "chunk_on_cache": 0, "resumed": 0, "mixed": 0}

    def next_step(self) -> tuple[AttentionMetadata, list[_Req]]:
        rng = self.rng
        if not self.requests or (len(self.requests) < 6 and rng.random() < 0.5):
            self.requests.append(_Req(num_tokens=rng.randint(1, 90)))
        started = [r for r in self.requests if r.num_computed > 0]
        if started and rng.random() < 0.1:
            victim = rng.choice(started)
            self.free.extend(victim.blocks)
            rng.shuffle(self.free)
            victim.blocks, victim.num_computed, victim.preempted = [], 0, True
        batch = [r for r in self.requests if rng.random() < 0.8] or self.requests[:1]
        query_lens, seq_lens = [], []
        for r in batch:
            if r.num_computed < r.num_tokens:
                num_new = rng.randint(1, r.num_tokens - r.num_computed)
                if r.num_computed > 0 and num_new > 1:
                    self.seen["chunk_on_cache"] += 1
                if r.preempted and r.num_computed == 0:
                    self.seen["resumed"] += 1
            else:
                r.num_tokens += 1  # the token sampled last step
                num_new = 1
            end = r.num_computed + num_new
            while len(r.blocks) * self.block_size < end:
                r.blocks.append(self.free.pop())
            query_lens.append(num_new)
            seq_lens.append(end)
        self.seen["decode_only" if all(q == 1 for q in query_lens) else "mixed"] += 1
        meta = _meta(query_lens, seq_lens, [list(r.blocks) for r in batch], self.block_size)
        for r, q in zip(batch, query_lens):
            r.num_computed += q
        for r in [r for r in self.requests if r.num_tokens >= 120]:
            self.free.extend(r.blocks)
            self.requests = [x for x in self.requests if x is not r]
        return meta, batch


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [(6, 2, 16), (4, 4, 8)], ids=["gqa", "mha"])
def test_emulated_flashinfer_matches_the_torch_backend_on_random_batches(block_size, heads):
    num_heads, num_kv_heads, head_dim = heads
    torch.manual_seed(block_size)
    batches = _RandomBatches(random.Random(block_size * 7 + num_heads), block_size,
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
    engine = LLM(attention=backend, block_size=block_size, num_kv_blocks=num_blocks, max_model_len=1024,
                 max_num_batched_tokens=48).engine
    for p in prompts:
        engine.add_request(engine.make_request(p, SamplingParams(temperature=0, max_tokens=6)))
    while engine.has_unfinished():
        engine.step()
    assert sum(s["num_preempted"] for s in engine.step_records) > 0
    assert any(s["num_prefill_seqs"] and s["num_decode_seqs"] for s in engine.step_records)
    assert backend.checked_steps == len(engine.step_records)
