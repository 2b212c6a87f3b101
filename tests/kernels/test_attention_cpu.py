"""The cpu attention backend against the torch reference on random paged batches: decodes, prefill chunks on
top of cached prefixes and whole prompts mixed in one step, block sizes 1/16/64, GQA and MHA, float32 and
bfloat16, on every kernel build (ISA level) the CPU supports. Both backends start from the same cache contents;
outputs and the written caches must agree."""

from __future__ import annotations

import random

import pytest
import torch

from nanovllm.attention.base import ATTENTION_BACKENDS, AttentionMetadata


def _random_step(rng: random.Random, block_size: int, num_blocks: int, num_seqs: int):
    """A step layout: per sequence a cached length and a query length (1 = decode), scattered block tables."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    query_lens, seq_lens, tables = [], [], []
    for i in range(num_seqs):
        kind = i % 3
        cached = rng.randint(1, 150) if kind != 2 else 0
        new = 1 if kind == 0 else rng.randint(2, 40)
        total = cached + new
        need = -(-total // block_size)
        tables.append([free.pop() for _ in range(need)])
        query_lens.append(new)
        seq_lens.append(total)
    slots = [tables[i][p // block_size] * block_size + p % block_size
             for i in range(num_seqs) for p in range(seq_lens[i] - query_lens[i], seq_lens[i])]
    return AttentionMetadata(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables,
                             slot_mapping=torch.tensor(slots, dtype=torch.long), block_size=block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (9, 3), (16, 2)], ids=["gqa", "mha", "gqa3", "gqa8"])
# 64 and 128 take the kernel's AVX-512 path (where the CPU has it), 32 its plain loop.
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("sdpa_min_query", [16, None], ids=["long-chunks-on-sdpa", "all-on-kernel"])
def test_cpu_backend_matches_torch_reference(dtype, block_size, heads, head_dim, sdpa_min_query, kernel_isa):
    num_heads, num_kv_heads = heads
    num_seqs = 7
    rng = random.Random(block_size * 100 + num_heads)
    torch.manual_seed(block_size + num_heads)
    num_blocks = num_seqs * (-(-200 // block_size)) + 4
    meta = _random_step(rng, block_size, num_blocks, num_seqs)
    tokens = sum(meta.query_lens)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    q = torch.randn(tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim).to(dtype)
    outputs, caches = [], []
    for spec in ("torch", {"name": "cpu", "sdpa_min_query": sdpa_min_query, "isa": kernel_isa}):
        backend = ATTENTION_BACKENDS.build(spec, num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
        own = cache.clone()
        backend.bind_kv_caches([(own[0], own[1])])
        backend.plan(meta)
        outputs.append(backend.forward(0, q, k, v).float())
        caches.append(own)
    assert torch.equal(caches[0], caches[1]), "the new K/V were written to different slots"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outputs[1], outputs[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_cpu_backend_reads_fused_projection_views_in_place(dtype, head_dim):
    """q, k and v as the fast path hands them over (row views of one fused q/k/v output, strided between tokens):
    the same output and the same cache writes, bit for bit, as from contiguous copies."""
    num_heads, num_kv_heads, block_size = 9, 3, 16
    meta = _random_step(random.Random(7), block_size, 64, 6)
    tokens = sum(meta.query_lens)
    torch.manual_seed(3)
    fused = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q, k, v = fused.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    views = (q.reshape(tokens, num_heads, head_dim), k.reshape(tokens, num_kv_heads, head_dim),
             v.reshape(tokens, num_kv_heads, head_dim))
    assert not views[0].is_contiguous()
    cache = torch.randn(2, 64, block_size, num_kv_heads, head_dim).to(dtype)
    results = []
    for inputs in (views, tuple(t.contiguous() for t in views)):
        backend = ATTENTION_BACKENDS.build("cpu", num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
        own = cache.clone()
        backend.bind_kv_caches([(own[0], own[1])])
        backend.plan(meta)
        results.append((backend.forward(0, *inputs), own))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_paged_attention_rejects_k_v_of_another_shape_than_the_cache():
    from nanovllm import kernels

    cache = torch.zeros(4, 16, 2, 64)
    q, k = torch.randn(1, 4, 64), torch.randn(1, 2, 64)
    with pytest.raises(RuntimeError, match="k and v must be"):
        kernels.load().paged_attention(q, k, torch.randn(1, 2, 32), cache, cache.clone(), torch.tensor([0]),
                                       torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                       torch.zeros(1, dtype=torch.int32), 0.125)


@pytest.mark.parametrize("head_dim", [8, 64])
def test_cpu_backend_reads_only_the_blocks_in_its_table(head_dim):
    """A decode whose table points at a few blocks ignores everything else in the cache (NaNs there included)."""
    backend = ATTENTION_BACKENDS.build("cpu", 2, 1, head_dim, head_dim ** -0.5)
    cache = torch.full((2, 6, 4, 1, head_dim), float("nan"))
    cache[:, [4, 1]] = torch.randn(2, 2, 4, 1, head_dim)
    backend.bind_kv_caches([(cache[0], cache[1])])
    meta = AttentionMetadata(query_lens=[1], seq_lens=[7], block_tables=[[4, 1]],
                             slot_mapping=torch.tensor([1 * 4 + 2]), block_size=4)
    backend.plan(meta)
    out = backend.forward(0, torch.randn(1, 2, head_dim), torch.randn(1, 1, head_dim), torch.randn(1, 1, head_dim))
    assert torch.isfinite(out).all()


def test_bad_sdpa_min_query_is_a_clear_error():
    with pytest.raises(ValueError, match="sdpa_min_query must be None or an integer >= 2"):
        ATTENTION_BACKENDS.build({"name": "cpu", "sdpa_min_query": 1}, 2, 1, 8, 1.0)


def test_auto_attention_is_the_cpu_kernel_on_cpu_and_the_reference_elsewhere():
    from nanovllm.attention.base import resolve_attention

    assert resolve_attention("auto", "cpu") == "cpu"
    assert resolve_attention({"name": "auto"}, torch.device("cuda")) == {"name": "torch"}
    assert resolve_attention("torch", "cpu") == "torch"


def test_default_engine_uses_the_cpu_backend(llm):
    assert llm.engine.runner.backend.registered_name == "cpu"
