"""8-bit KV caches (``kv_cache_dtype=int8`` / ``fp8_e4m3``) in both attention backends, on every kernel build
(ISA level) the CPU supports: the cpu kernel and the torch reference write the same bytes and attend to the same
output; both stay close to attention over the unquantized float32 cache, on random paged steps (decodes, prefill
chunks on cached prefixes, whole prompts) and over many steps of requests that prefill, decode and are
preempted. The model-dtype paths are untouched (tests/kernels/test_attention_cpu.py).

Tolerances, from the error measured on these random inputs (unit-variance q/k/v, 1-190 keys, every case of the
first test, float32 and bfloat16 alike): the relative error ``||out - exact|| / ||exact||`` of int8 was
0.0065-0.0084 and of fp8_e4m3 0.029-0.032 (3 mantissa bits); the bounds below are about twice the worst. A cache that ignored its scales, or the wrong rows, is off by ~1 (checked)."""

from __future__ import annotations

import random

import pytest
import torch

from nanovllm.attention import kv_quant
from nanovllm.attention.base import ATTENTION_BACKENDS, AttentionMetadata
from paged_batches import RandomBatches
from test_attention_cpu import _random_step

REL_TOL = {"int8": 0.015, "fp8_e4m3": 0.06}


def _relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.float() - exact).norm() / exact.norm())


def _attend(spec, cache: torch.Tensor, meta, q, k, v, heads, head_dim) -> torch.Tensor:
    num_heads, num_kv_heads = heads
    backend = ATTENTION_BACKENDS.build(spec, num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    backend.bind_kv_caches([(cache[0], cache[1])])
    backend.plan(meta)
    return backend.forward(0, q, k, v)


@pytest.mark.parametrize("fmt", sorted(kv_quant.FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (9, 3)], ids=["gqa", "mha", "gqa3"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("sdpa_min_query", [16, None], ids=["long-chunks-on-sdpa", "all-on-kernel"])
def test_8bit_cache_cpu_kernel_matches_torch_reference_and_stays_close_to_float32(
        fmt, dtype, block_size, heads, head_dim, sdpa_min_query, kernel_isa):
    num_heads, num_kv_heads = heads
    rng = random.Random(block_size * 100 + num_heads + head_dim)
    torch.manual_seed(block_size + num_heads + head_dim)
    num_blocks = 7 * (-(-200 // block_size)) + 4
    meta = _random_step(rng, block_size, num_blocks, 7)
    tokens = sum(meta.query_lens)
    values = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    q = torch.randn(tokens, num_heads, head_dim).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim).to(dtype)
    packed = kv_quant.quantize(values, kv_quant.FORMATS[fmt])
    assert packed.dtype == kv_quant.FORMATS[fmt].storage and packed.shape[-1] == head_dim + 4
    caches = [packed.clone(), packed.clone()]
    ours = _attend({"name": "cpu", "sdpa_min_query": sdpa_min_query, "isa": kernel_isa}, caches[0], meta, q, k, v,
                   heads, head_dim)
    reference = _attend("torch", caches[1], meta, q, k, v, heads, head_dim)
    assert ours.dtype == dtype
    # Same quantization arithmetic on both sides: the new rows' bytes (codes and scales) are identical.
    assert torch.equal(caches[0], caches[1])
    assert not torch.equal(caches[0], packed), "the new K/V were not written"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), reference.float(), atol=tol, rtol=tol)
    exact = _attend("torch", values.float().clone(), meta, q.float(), k.float(), v.float(), heads, head_dim)
    error = _relative_error(ours, exact)
    assert error < REL_TOL[fmt], error


@pytest.mark.parametrize("fmt", sorted(kv_quant.FORMATS))
def test_8bit_cache_over_many_steps_of_prefill_decode_and_preemption(fmt, kernel_isa):
    """Requests through chunked prefill, decode and preemption (recomputed in new blocks), the same random
    q/k/v each step for three caches: cpu 8-bit, torch 8-bit, torch float32. The 8-bit backends agree with each
    other and stay close to float32 at every step, so what was written steps ago is read back right."""
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 96
    batches = RandomBatches(random.Random(5), block_size, num_blocks)
    torch.manual_seed(5)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim + 4)
    storage = kv_quant.FORMATS[fmt].storage
    cpu_cache, torch_cache = torch.zeros(shape, dtype=storage), torch.zeros(shape, dtype=storage)
    exact_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    backends = []
    for spec, cache in (({"name": "cpu", "isa": kernel_isa}, cpu_cache), ("torch", torch_cache),
                        ("torch", exact_cache)):
        backend = ATTENTION_BACKENDS.build(spec, num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
        backend.bind_kv_caches([(cache[0], cache[1])])
        backends.append(backend)
    worst = 0.0
    for _ in range(40):
        meta, _ = batches.next_step()
        tokens = sum(meta.query_lens)
        q = torch.randn(tokens, num_heads, head_dim)
        k, v = torch.randn(tokens, num_kv_heads, head_dim), torch.randn(tokens, num_kv_heads, head_dim)
        outs = []
        for backend in backends:
            backend.plan(meta)
            outs.append(backend.forward(0, q, k, v))
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
        worst = max(worst, _relative_error(outs[0], outs[2]))
    assert torch.equal(cpu_cache, torch_cache)
    assert batches.seen["chunk_on_cache"] and batches.seen["resumed"] and batches.seen["decode_only"]
    assert worst < REL_TOL[fmt], worst


@pytest.mark.parametrize("fmt", sorted(kv_quant.FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_8bit_code_decodes_exactly_in_the_cpu_kernel(fmt, dtype, kernel_isa):
    """Each of the format's finite codes is read back as the value kv_quant.dequantize gives it, on every kernel
    build (the AVX-512 and AVX2 kernels decode e4m3 through float16's bit layout, the portable loop through a
    table).
    One sequence per code: its cached key 0 is a value row of that code (scale 1), key 1 the step's new all-zero
    row; a zero query weighs both keys 1/2, so the output is exactly half the decoded code."""
    spec = kv_quant.FORMATS[fmt]
    if fmt == "int8":
        codes = torch.arange(-127, 128, dtype=torch.int16).to(torch.int8).view(torch.uint8)  # the quantizer's range
    else:
        codes = torch.arange(256, dtype=torch.int16).to(torch.uint8)
        codes = codes[torch.isfinite(codes.view(torch.float8_e4m3fn).float())]
    num_heads, head_dim, n = 3, 64, codes.numel()
    cache = torch.zeros(2, 2 * n, 1, 1, head_dim + 4, dtype=spec.storage)
    row = cache.view(torch.uint8)[:, 0::2, 0, 0]  # key 0 of every sequence
    row[:, :, :head_dim] = codes.view(n, 1)
    row[:, :, head_dim:] = torch.tensor([1.0]).view(torch.uint8)
    meta = AttentionMetadata(query_lens=[1] * n, seq_lens=[2] * n, block_tables=[[2 * i, 2 * i + 1] for i in range(n)],
                             slot_mapping=torch.arange(1, 2 * n, 2), block_size=1)
    zeros_q, zeros_kv = torch.zeros(n, num_heads, head_dim, dtype=dtype), torch.zeros(n, 1, head_dim, dtype=dtype)
    out = _attend({"name": "cpu", "isa": kernel_isa}, cache, meta, zeros_q, zeros_kv, zeros_kv, (num_heads, 1),
                  head_dim)
    decoded = kv_quant.dequantize(cache[1, 0::2, 0, 0], spec)[:, 0]  # one value per code, float32
    assert decoded.abs().max() == spec.qmax and torch.unique(decoded).numel() == n - (fmt == "fp8_e4m3")  # +-0
    expected = (decoded / 2).to(dtype).view(n, 1).expand(n, num_heads * head_dim)
    assert torch.equal(out, expected)


def test_a_cache_read_without_its_scales_is_far_off():
    """The closeness bounds above can fail: the same codes read as if every scale were 1 are nowhere near."""
    torch.manual_seed(0)
    fmt = kv_quant.FORMATS["int8"]
    x = torch.randn(50, 3, 64)
    packed = kv_quant.quantize(x, fmt)
    assert _relative_error(kv_quant.dequantize(packed, fmt), x) < REL_TOL["int8"]
    unscaled = packed[..., :64].view(fmt.payload).float()
    assert _relative_error(unscaled, x) > 1.0


@pytest.mark.parametrize("fmt", sorted(kv_quant.FORMATS))
def test_quantize_is_per_token_and_head_symmetric_and_keeps_zero_rows_finite(fmt):
    spec = kv_quant.FORMATS[fmt]
    x = torch.randn(5, 2, 32)
    x[1, 0] = 0.0                 # an all-zero head row: scale 0, codes 0, no NaN
    x[2, 1] *= 1000.0             # an outlier row costs only its own precision
    packed = kv_quant.quantize(x, spec)
    scales = packed[..., 32:].contiguous().view(torch.float32).squeeze(-1)
    torch.testing.assert_close(scales, x.abs().amax(-1) / spec.qmax)
    back = kv_quant.dequantize(packed, spec)
    assert torch.isfinite(back).all() and torch.equal(back[1, 0], torch.zeros(32))
    # Each row's largest magnitude is represented exactly (it maps to +-QMAX).
    rows = back.abs().amax(-1)
    torch.testing.assert_close(rows, x.abs().amax(-1), rtol=1e-6, atol=0)
    assert _relative_error(back[0], x[0]) < REL_TOL[fmt]


@pytest.mark.parametrize("fmt", sorted(kv_quant.FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query", ["random", "zero"])
def test_long_8bit_decodes_match_the_reference(fmt, dtype, query, kernel_isa):
    """Decodes over 1,500 cached keys, past the lengths of the random steps above: the bf16 kernel's int8 path
    sums its int16 products in int32 over at most 256 keys at a time: a zero query weighs every key alike, near
    the largest int16 weight, and over values all near 1 (codes near 127) a sum over all 1,500 keys would
    overflow (1,500 x ~32,000 x ~100 > 2^31). The output stays the torch reference's, and with the zero query it
    is the mean of the dequantized values."""
    num_heads, num_kv_heads, head_dim, block_size, keys, seqs = 9, 3, 64, 16, 1500, 3
    torch.manual_seed(7)
    blocks_per_seq = -(-keys // block_size)
    order = torch.randperm(seqs * blocks_per_seq).view(seqs, blocks_per_seq)
    meta = AttentionMetadata(query_lens=[1] * seqs, seq_lens=[keys] * seqs, block_tables=order.tolist(),
                             slot_mapping=order[:, (keys - 1) // block_size] * block_size + (keys - 1) % block_size,
                             block_size=block_size)
    values = torch.randn(2, seqs * blocks_per_seq, block_size, num_kv_heads, head_dim)
    values = (1 + 0.1 * values if query == "zero" else values).to(dtype)
    packed = kv_quant.quantize(values, kv_quant.FORMATS[fmt])
    make = torch.zeros if query == "zero" else torch.randn
    q = make(seqs, num_heads, head_dim).to(dtype)
    k, v = (make(seqs, num_kv_heads, head_dim).to(dtype) for _ in range(2))
    ours = _attend({"name": "cpu", "isa": kernel_isa}, packed.clone(), meta, q, k, v, (num_heads, num_kv_heads),
                   head_dim)
    written = packed.clone()
    reference = _attend("torch", written, meta, q, k, v, (num_heads, num_kv_heads), head_dim)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), reference.float(), atol=tol, rtol=tol)
    if query == "zero":  # every key weighs 1 / keys: the mean of each sequence's dequantized V rows
        dequantized = kv_quant.dequantize(written[1], kv_quant.FORMATS[fmt]).flatten(0, 1)  # [slots, KVH, D]
        rows = torch.stack([dequantized[(order[i, :, None] * block_size + torch.arange(block_size)).flatten()[:keys]]
                            for i in range(seqs)])  # [seqs, keys, KVH, D]
        mean = rows.mean(1).repeat_interleave(num_heads // num_kv_heads, dim=1).flatten(1)
        torch.testing.assert_close(ours.float(), mean, atol=tol, rtol=tol)
