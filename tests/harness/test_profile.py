"""``nanovllm.profile``'s GEMM floor of a recorded run: which matmuls it counts (no timing is asserted)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from helpers import random_quant_linear
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.profile import run_gemm_floor


def _record(prefill: int, decode: int, sampled: int) -> dict:
    return {"num_prefill_tokens": prefill, "num_decode_tokens": decode, "num_sampled": sampled}


def test_run_gemm_floor_counts_every_step_s_matmuls_once_per_step():
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config, max_positions=64).eval()
    records = [_record(10, 0, 2), _record(0, 2, 2), _record(0, 2, 2), _record(0, 2, 2), _record(3, 2, 3),
               _record(0, 0, 0)]  # an idle step computes nothing
    seconds, gflop = run_gemm_floor(model, records, torch.float32)
    per_row = 2 * config.num_hidden_layers * config.hidden_size * (
        (4 + 2 + 2) * 16 + 64 + 3 * config.intermediate_size)  # q, k, v (head_dim 16), o, gate, up, down
    head = 2 * config.hidden_size * config.vocab_size
    rows, sampled = 10 + 3 * 2 + 5, 2 + 3 * 2 + 3
    assert gflop == pytest.approx((rows * per_row + sampled * head) / 1e9, rel=1e-9)
    assert seconds > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_breakdown_counts_every_fast_path_linear_kernel_as_a_linear(dtype):
    """Whichever kernel this CPU's fast path picks (brgemm, oneDNN, the GEMV, bf16-fma), the profile's "linears" column
    counts its calls: one profiled call per row count must show up there."""
    from torch.profiler import ProfilerActivity, profile

    from nanovllm import kernels
    from nanovllm.models.fast_path import PackedLinear, can_prepack
    from nanovllm.profile import breakdown

    weight = torch.randn(96, 64).to(dtype)
    if can_prepack(weight, kernels.load()):
        linear = PackedLinear(weight, kernels=kernels.load())
    else:  # the fast path keeps a plain nn.Linear where no packed kernel takes the weight (bf16 at the scalar level)
        linear = torch.nn.Linear(64, 96, bias=False, dtype=dtype)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for rows in (1, 2, 32):
            linear(torch.randn(rows, 64).to(dtype))
    assert breakdown(prof.events(), steps=1)["linears"] > 0, sorted({e.name for e in prof.events()})


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_1"])
def test_breakdown_counts_every_quantized_linear_kernel_as_a_linear(fmt, compiled):
    """The quantized layers' kernels (the vector quant_linear, int8 on AMX tiles, Q4 interleaved by 16 features:
    whichever this build and CPU give the layer) are linears in the profile too."""
    from torch.profiler import ProfilerActivity, profile

    from nanovllm.profile import breakdown

    k = 64
    layer = random_quant_linear(fmt, 48, k, torch.Generator().manual_seed(0), compiled)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for rows in (1, 32):
            layer(torch.randn(rows, k))
    assert breakdown(prof.events(), steps=1)["linears"] > 0, (layer.kernel, sorted({e.name for e in prof.events()}))
