"""``kv_cache_dtype`` (auto / int8 / fp8_e4m3): the option's checks, the memory model (a fixed
``kv_cache_memory`` holds ~2x the blocks of a bfloat16 cache, ~4x a float32 one, less the scales' bytes), what the
cost model counts per token, and the simulator's view of it: the same memory admits ~2x the tokens, so a
saturating workload preempts less. No model is loaded (the simulator's engine is the real scheduler and allocator
sized by the real ``bytes_per_block``). The kernels: tests/kernels/test_attention_8bit.py; generation on the real
model: tests/models/test_kv_cache_dtype.py."""

from __future__ import annotations

import pytest
import torch

from nanovllm.attention.base import check_kv_cache_dtype
from nanovllm.attention.torch_backend import TorchAttention
from nanovllm.config import EngineConfig
from nanovllm.engine.kv_cache import allocate_kv_cache, bytes_per_block
from nanovllm.harness.sim import Simulation
from nanovllm.harness.workload import WorkloadRequest
from nanovllm.serving.monitor import ModelCost

# SmolLM2-135M: 30 layers, 3 KV heads of 64; 16-token blocks.
GEOMETRY = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
MEMORY = 40 * 2**20


@pytest.mark.parametrize("bad", ["int4", "fp8", "bfloat16", "INT8", None, 8])
def test_a_bad_kv_cache_dtype_is_refused_naming_the_field_and_the_allowed_values(bad):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, int8, fp8_e4m3, got"):
        EngineConfig(kv_cache_dtype=bad)


def test_8bit_kv_under_tensor_parallelism_is_refused_by_name():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' is not supported with tensor_parallel_size > 1"):
        EngineConfig(kv_cache_dtype="int8", tensor_parallel_size=2)
    assert EngineConfig(kv_cache_dtype="auto", tensor_parallel_size=2).kv_cache_dtype == "auto"


def test_a_backend_without_8bit_caches_is_refused_before_the_load_and_at_binding():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' is not supported by attention backend "
                                         r"'flashinfer' \(supported: auto\)"):
        check_kv_cache_dtype("flashinfer", "int8", "cuda")
    check_kv_cache_dtype("auto", "fp8_e4m3", "cpu")  # cpu on CPU
    check_kv_cache_dtype("torch", "int8", "cpu")

    class ModelDtypeOnly(TorchAttention):
        registered_name = "model_dtype_only"
        kv_cache_dtypes = ("auto",)

    backend = ModelDtypeOnly(4, 2, 32, 32 ** -0.5)
    _, views = allocate_kv_cache(1, 4, 16, 2, 32, torch.float32, torch.device("cpu"), "int8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' is not supported by attention backend "
                                         r"'model_dtype_only'"):
        backend.bind_kv_caches(views)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' is not supported"):
        check_kv_cache_dtype(backend, "fp8_e4m3", "cpu")


def test_bytes_per_block_counts_the_8bit_codes_and_the_scales():
    bf16 = bytes_per_block(**GEOMETRY, dtype=torch.bfloat16)
    fp32 = bytes_per_block(**GEOMETRY, dtype=torch.float32)
    int8 = bytes_per_block(**GEOMETRY, dtype=torch.bfloat16, kv_cache_dtype="int8")
    assert bf16 == 2 * 30 * 16 * 3 * 64 * 2
    assert fp32 == 2 * bf16
    # One byte per value plus a float32 scale per (token, KV head), whatever the model dtype.
    assert int8 == 2 * 30 * 16 * 3 * (64 + 4)
    assert bytes_per_block(**GEOMETRY, dtype=torch.float32, kv_cache_dtype="fp8_e4m3") == int8
    cache, views = allocate_kv_cache(30, 5, 16, 3, 64, torch.bfloat16, torch.device("cpu"), "int8")
    assert cache.dtype == torch.int8 and cache.numel() * cache.element_size() == 5 * int8
    assert views[0][0].shape == (5, 16, 3, 68)
    fp8, _ = allocate_kv_cache(1, 1, 16, 3, 64, torch.float32, torch.device("cpu"), "fp8_e4m3")
    assert fp8.dtype == torch.uint8


def _sim(kv_cache_dtype: str, dtype: str = "bfloat16", memory: int = MEMORY) -> Simulation:
    config = EngineConfig(dtype=dtype, kv_cache_memory=memory, kv_cache_dtype=kv_cache_dtype, max_num_seqs=64,
                          max_model_len=1024)
    return Simulation.build(config, {"name": "token_cost", "step_overhead": 0.01, "time_per_token": 1e-4})


def test_a_fixed_kv_cache_memory_holds_about_twice_the_blocks_in_8bit(tokenizer):
    memory = 400 * 2**20  # large enough that rounding to whole blocks is below 1%
    blocks = {(dtype, kv): _sim(kv, dtype, memory).engine.num_kv_blocks
              for dtype, kv in [("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "int8"),
                                ("float32", "int8"), ("bfloat16", "fp8_e4m3")]}
    int8 = blocks[("bfloat16", "int8")]
    assert int8 == memory // (2 * 30 * 16 * 3 * 68) == blocks[("float32", "int8")] == blocks[("bfloat16", "fp8_e4m3")]
    # 2x and 4x the values per byte, less the 4 scale bytes per 64-value row: 128/68 and 256/68.
    assert int8 / blocks[("bfloat16", "auto")] == pytest.approx(128 / 68, rel=0.01)
    assert int8 / blocks[("float32", "auto")] == pytest.approx(256 / 68, rel=0.01)
    assert int8 >= 1.85 * blocks[("bfloat16", "auto")]


def test_the_cost_model_counts_the_8bit_bytes_per_token(tokenizer):
    auto, int8 = _sim("auto").cost, _sim("int8").cost
    assert auto.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert int8.kv_bytes_per_token == 2 * 30 * 3 * 68
    step = {"num_prefill_tokens": 0, "num_decode_tokens": 8, "context_tokens": 4000}
    # MBU's bytes: the weights are the same, the KV read and written shrink.
    assert auto.step_bytes(step) - int8.step_bytes(step) == pytest.approx(
        (4000 + 8) * (auto.kv_bytes_per_token - int8.kv_bytes_per_token))
    assert ModelCost.from_hf_config(_sim("auto").engine.hf_config, torch.float32, "fp8_e4m3").kv_bytes_per_token == \
        int8.kv_bytes_per_token


def test_the_simulator_admits_about_twice_the_tokens_and_preempts_less_with_8bit_kv(tokenizer):
    """One saturating workload (60 requests of 400 + 200 tokens arriving at once) on the same 40 MiB: the
    8-bit cache holds ~1.9x the tokens at its fullest and preempts less."""
    workload = [WorkloadRequest(arrival_time=0.0, prompt=[(7 * i + j) % 5000 + 10 for j in range(400)],
                                max_tokens=200, ignore_eos=True) for i in range(60)]
    results = {kv: _sim(kv).serve(workload) for kv in ("auto", "int8")}
    peak = {kv: max(s["kv_blocks_used"] for s in r.steps) for kv, r in results.items()}
    running = {kv: max(s["num_running"] for s in r.steps) for kv, r in results.items()}
    for result in results.values():
        assert result.summary["completed"] == 60
    assert peak["int8"] >= 1.8 * peak["auto"], peak
    assert running["int8"] >= 1.6 * running["auto"], running
    assert results["int8"].summary["num_preemptions"] < results["auto"].summary["num_preemptions"]


def test_a_calibrated_profile_of_the_model_dtype_cache_says_so_for_an_8bit_run(tmp_path, monkeypatch):
    from nanovllm.harness.sim import this_machine
    from nanovllm.harness.sim.step_time import CalibratedStepTime

    monkeypatch.setenv(this_machine.PROFILES_ENV, str(tmp_path))  # the shipped profile, not a cached one
    assert CalibratedStepTime(dtype="float32").kv_cache_warning() is None
    warning = CalibratedStepTime(dtype="float32", kv_cache_dtype="int8").kv_cache_warning()
    assert warning is not None and "engine.kv_cache_dtype=auto, this run uses int8" in warning
