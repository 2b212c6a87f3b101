"""The cost model against real transformers models, the FLOP/byte formulas by hand, and MFU on real matmuls."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch
import transformers

from helpers import step_record
from nanovllm.serving.monitor import (
    ModelCost,
    Monitor,
    MonitorConfig,
    measure_peak_bandwidth,
    measure_peak_flops,
)

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97)


CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "llama_bias_tied": lambda: transformers.LlamaConfig(**TINY, attention_bias=True, mlp_bias=True,
                                                        tie_word_embeddings=True),
    "llama_head_dim": lambda: transformers.LlamaConfig(**TINY, head_dim=24),  # head_dim != hidden/heads
    "qwen2": lambda: transformers.Qwen2Config(**TINY),                        # q/k/v biases, no head_dim
    "qwen3_tied": lambda: transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),  # q/k norms
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_counts_match_transformers(name: str) -> None:
    config = CONFIGS[name]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    cost = ModelCost.from_hf_config(config, torch.float32)

    layer_linear = sum(
        p.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()
    )
    assert cost.linear_params == layer_linear
    assert cost.lm_head_params == model.lm_head.weight.numel()
    assert cost.total_params == sum(p.numel() for p in model.parameters())  # tied weights counted once


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cost_of_the_built_model_counts_what_it_holds(name: str) -> None:
    """The monitor's cost comes from the engine's own built model, and agrees with transformers' count."""
    from nanovllm.models.llama import LlamaForCausalLM

    config = CONFIGS[name]()
    ours = LlamaForCausalLM(config, max_positions=64).to(torch.bfloat16)
    cost = ModelCost.from_model(ours)
    reference = transformers.AutoModelForCausalLM.from_config(config)
    assert cost.total_params == sum(p.numel() for p in ours.parameters()) == \
        sum(p.numel() for p in reference.parameters())
    assert cost == ModelCost.from_hf_config(config, torch.bfloat16)  # one bias rule for builder and cost
    assert cost.bytes_per_element == 2


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_cost_counts_the_bytes_the_weights_are_stored_in(quantization: str | None) -> None:
    """MBU divides by what a step really streams: int8 codes and their scales, not the model dtype's 2 bytes a
    weight. The built model's own accounting (its linears' stored tensors) is what the cost takes."""
    from nanovllm.models.fast_path import linear_kernel, linear_weight_bytes
    from nanovllm.models.llama import LlamaForCausalLM
    from nanovllm.models.quantized import int8_kernel, int8_weight_bytes

    config = CONFIGS["llama"]()
    model = LlamaForCausalLM(config, max_positions=64).to(torch.bfloat16).use_fast_path(quantization)
    cost = ModelCost.from_model(model)
    dense = ModelCost.from_hf_config(config, torch.bfloat16)
    stored, weights = model.streamed_weights()
    assert weights == dense.linear_params + dense.lm_head_params
    # What this CPU's dispatch stores: each kernel's layout pads the output features to its blocks (brgemm 32,
    # bf16-fma 16 and i8x16 64 features, the tiles 16 features and K to 64); tests/kernels/test_dispatch.py
    # holds each CPU kind's figures.
    shapes = [(layer.out_features, layer.in_features) for layer in model.linear_layers() + model.lm_head_layers()]
    if quantization is None:
        kernel = linear_kernel(torch.bfloat16)
        assert stored == sum(linear_weight_bytes(kernel, n, k, torch.bfloat16) for n, k in shapes)
    else:
        kernel = int8_kernel(model.kernels)
        assert stored == sum(int8_weight_bytes(kernel, n, k) for n, k in shapes)
    assert cost.weight_bytes == stored
    assert cost.int8_matmuls == (quantization is not None)
    if quantization is None:
        # Only the bytes a weight differ from the unbuilt model's, and only where the layout pads.
        assert dataclasses.replace(cost, bytes_per_weight=None) == dense
        assert (cost.bytes_per_weight is None) == (stored == 2 * weights)
    else:
        # The same engine not built (the simulator's cost): one byte a weight and a float32 scale per output
        # channel (q 64, k 32, v 32, o 64, gate 160, up 160, down 64 a layer, 97 in the head), without the
        # built layers' padding to 64 channels; the embedding and norms in bf16 beside them in memory.
        unbuilt = ModelCost.from_hf_config(config, torch.bfloat16, quantization="int8")
        assert unbuilt.int8_matmuls and unbuilt.weight_bytes == weights + 4 * (3 * 576 + 97) <= stored
        assert unbuilt.weight_memory_bytes == unbuilt.weight_bytes + 2 * (97 * 64 + 3 * 2 * 64 + 64)
        assert dense.weight_memory_bytes == 2 * dense.total_params
        # One byte a weight, a float32 scale per output channel, codes padded to the kernel's blocks.
        assert weights < stored < 1.3 * weights
        step = step_record(num_decode_tokens=4, num_sampled=4, context_tokens=40)
        kv = (4 + 40) * cost.kv_bytes_per_token
        assert cost.step_bytes(step) - kv == stored == pytest.approx((dense.step_bytes(step) - kv) / 2, rel=0.3)


def test_int8_models_are_measured_against_the_int8_peak(monkeypatch) -> None:
    """A model whose linears multiply in int8 gets int8's calibrated peak for its MFU (a matmul of int8 codes,
    torch._int_mm), a dense one its dtype's. Which peak is measured is the rule; how the two peaks compare is
    the CPU's (on AMX, bf16 runs on tiles too and int8 gains little), so no ratio between them is asserted."""
    from nanovllm.serving import monitor

    measured: list[torch.dtype] = []

    def measure(dtype, device="cpu", seconds=0.5):
        measured.append(dtype)
        return monitor_measure(dtype, device, seconds=0.3)

    monitor_measure = monitor.measure_peak_flops
    monkeypatch.setattr(monitor, "measure_peak_flops", measure)
    dense = ModelCost.from_hf_config(transformers.LlamaConfig(**TINY), torch.bfloat16)
    int8 = dataclasses.replace(dense, int8_matmuls=True, bytes_per_weight=1.0)
    for cost, expected in [(int8, torch.int8), (dense, torch.bfloat16)]:
        calibrated = Monitor.from_config(cost, MonitorConfig(peak_bandwidth=1e10), torch.bfloat16)
        assert measured[-1] == expected and 1e8 < calibrated.peak_flops < 1e15
    assert len(measured) == 2


def test_head_dim_missing_falls_back_and_bytes_follow_dtype() -> None:
    config = SimpleNamespace(**TINY, tie_word_embeddings=False)  # no head_dim attribute at all
    cost = ModelCost.from_hf_config(config, torch.bfloat16)
    assert cost.head_dim == 16
    assert cost.bytes_per_element == 2
    # K and V, 3 layers, 2 kv heads of 16, 2 bytes each.
    assert cost.kv_bytes_per_token == 2 * 3 * 2 * 16 * 2


def test_step_flops_and_bytes_by_hand() -> None:
    cost = ModelCost.from_hf_config(transformers.LlamaConfig(**TINY), torch.float16)
    h, i, layers, heads, kv_heads, d, vocab = 64, 160, 3, 4, 2, 16, 97
    per_layer = h * heads * d + 2 * h * kv_heads * d + heads * d * h + 3 * h * i
    assert cost.linear_params == layers * per_layer

    step = step_record(num_prefill_tokens=10, num_decode_tokens=3, num_sampled=4, attn_pairs=70, context_tokens=25)
    expected_flops = 2 * layers * per_layer * 13 + 2 * h * vocab * 4 + 4 * 70 * heads * d * layers
    assert cost.step_flops(step) == expected_flops

    kv_per_token = 2 * layers * kv_heads * d * 2
    expected_bytes = (layers * per_layer + h * vocab) * 2 + 25 * kv_per_token + 13 * kv_per_token
    assert cost.step_bytes(step) == expected_bytes


def test_annotate_and_overall() -> None:
    cost = ModelCost.from_hf_config(transformers.LlamaConfig(**TINY), torch.float32)
    monitor = Monitor(cost, peak_flops=1e9, peak_bandwidth=1e10)
    steps = [step_record(step=0, duration=0.5, num_prefill_tokens=8, num_sampled=1, attn_pairs=36, context_tokens=8),
             step_record(step=1, duration=0.25, num_decode_tokens=1, num_sampled=1, attn_pairs=9, context_tokens=9)]

    annotated = monitor.annotate(steps[0])
    assert "mfu" not in steps[0]  # the record itself is left alone
    assert annotated["flops"] == cost.step_flops(steps[0])
    assert annotated["mfu"] == pytest.approx(annotated["flops"] / 0.5 / 1e9)
    assert annotated["mbu"] == pytest.approx(annotated["bytes"] / 0.5 / 1e10)

    overall = monitor.overall(steps)
    total_flops = sum(cost.step_flops(s) for s in steps)
    assert overall["total_flops"] == total_flops
    assert overall["mfu"] == pytest.approx(total_flops / 0.75 / 1e9)
    assert overall["peak_flops"] == 1e9 and overall["peak_bandwidth"] == 1e10

    unknown = Monitor(cost, peak_flops=None, peak_bandwidth=None)
    assert unknown.annotate(steps[0])["mfu"] is None
    assert unknown.overall(steps)["mbu"] is None
    assert Monitor(cost, 1e9, 1e10).annotate(step_record(duration=0.0))["mfu"] is None


def test_monitor_from_config_uses_given_peaks_or_none() -> None:
    cost = ModelCost.from_hf_config(transformers.LlamaConfig(**TINY), torch.float32)
    given = Monitor.from_config(cost, MonitorConfig(peak_flops=2e12, peak_bandwidth=3e11), torch.float32)
    assert (given.peak_flops, given.peak_bandwidth) == (2e12, 3e11)
    none = Monitor.from_config(cost, MonitorConfig(calibrate=False), torch.float32)
    assert (none.peak_flops, none.peak_bandwidth) == (None, None)


def test_calibration_is_plausible() -> None:
    start = time.perf_counter()
    peak = measure_peak_flops(torch.float32, "cpu", seconds=0.3)
    assert 1e8 < peak < 1e14
    assert time.perf_counter() - start < 3  # a calibration must not hold up a run
    assert 1e8 < measure_peak_bandwidth("cpu", nbytes=64 << 20, repeats=3) < 1e13


def _model_matmuls(cost: ModelCost, tokens: int, sampled: int):
    """The dense matmuls of one forward over ``tokens`` tokens of ``cost``'s model, as a callable."""
    h, q, kv, i = cost.hidden_size, cost.q_size, cost.kv_size, cost.intermediate_size
    weights = [torch.randn(h, n) for n in (q, kv, kv, i, i)]
    o, down = torch.randn(q, h), torch.randn(i, h)
    lm_head = torch.randn(h, cost.vocab_size)
    x, attn_out, act = torch.randn(tokens, h), torch.randn(tokens, q), torch.randn(tokens, i)

    def forward() -> None:
        for _ in range(cost.num_layers):
            for w in weights:
                x @ w
            attn_out @ o
            act @ down
        x[-sampled:] @ lm_head

    return forward


def _best_time(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def test_mfu_of_real_matmuls_is_in_unit_interval() -> None:
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=2048)
    cost = ModelCost.from_hf_config(config, torch.float32)
    forward = _model_matmuls(cost, tokens=256, sampled=4)
    # Best-of-N on both sides (like the calibration itself), and a few attempts: on a shared 2-core machine
    # another process can slow either measurement; a wrong formula fails every attempt, noise does not.
    mfus = []
    for _ in range(3):
        step = step_record(duration=_best_time(forward), num_prefill_tokens=256, num_sampled=4)
        monitor = Monitor(cost, measure_peak_flops(torch.float32, "cpu", seconds=0.3), peak_bandwidth=None)
        mfus.append(monitor.annotate(step)["mfu"])
        # Same kind of work as the calibration: close to peak, not orders of magnitude off.
        if 0.02 < mfus[-1] <= 1:
            return
    pytest.fail(f"MFU of real matmuls outside (0.02, 1]: {mfus}")
