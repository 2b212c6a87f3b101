"""Tensor parallelism inside a simulated replica (``engine.tensor_parallel_size`` with ``runner=sim``): the
replica has N GPUs' memory for weights and KV cache, its step's work is split over them, and its collectives
(two all-reduces of the hidden states a layer, one gather of the logits) are priced on ``hardware``'s link
between the GPUs. Every expectation is derived from the hardware description and the model's shape."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from helpers import REPO
from nanovllm.config import EngineConfig
from nanovllm.harness.sim import Hardware, Simulation
from nanovllm.harness.sim.step_time import AnalyticalStepTime, tensor_parallel_seconds
from nanovllm.harness.workload import WorkloadRequest

H100 = Hardware.from_config(yaml.safe_load((REPO / "conf" / "hardware" / "h100_sxm.yaml").read_text()))
DECODE = {"num_prefill_tokens": 0, "num_decode_tokens": 8, "num_decode_seqs": 8, "num_sampled": 8,
          "context_tokens": 8 * 2000, "attn_pairs": 8 * 2000, "num_prefill_seqs": 0}


def _model_dir(name: str):
    return REPO / yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())["path"]


def _simulation(name: str, tp: int, hardware: Hardware = H100, **options) -> Simulation:
    return Simulation.build(EngineConfig(model=str(_model_dir(name)), dtype="bfloat16", max_num_seqs=8,
                                         tensor_parallel_size=tp, **options), "analytical", hardware=hardware)


def test_a_70b_model_is_refused_on_one_h100_with_the_fix_and_fits_on_four():
    with pytest.raises(ValueError, match="engine.tensor_parallel_size") as refused:
        _simulation("llama3_1_70b_config", 1)
    assert "hardware.memory_bytes" in str(refused.value)
    sim = _simulation("llama3_1_70b_config", 4)
    usable = 4 * H100.memory_bytes * H100.memory_fraction
    assert sim.engine.config.kv_cache_memory == int(usable - sim.cost.weight_memory_bytes)
    request = WorkloadRequest(arrival_time=0.0, prompt=[10 + i % 1000 for i in range(4000)], max_tokens=4,
                              ignore_eos=True, request_id="0")
    record, = sim.serve([request]).requests
    assert record["error"] is None and record["num_output_tokens"] == 4


def test_the_step_is_split_over_the_gpus_and_its_collectives_added():
    sim = _simulation("llama3_1_8b_config", 1)
    one = AnalyticalStepTime(sim.cost, H100, "bfloat16")
    for tp in (2, 4, 8):
        split = AnalyticalStepTime(sim.cost, H100, "bfloat16", tensor_parallel_size=tp)
        work = one.predict(DECODE, 0.0) - H100.step_overhead
        comm = tensor_parallel_seconds(sim.cost, H100, tp, DECODE)
        assert split.predict(DECODE, 0.0) == pytest.approx(H100.step_overhead + work / tp + comm)
        # Two all-reduces a layer and one logits gather, each at least the link's latency.
        assert comm >= (2 * sim.cost.num_layers + 1) * H100.tp_link_latency
    # A ring all-reduce moves 2 (tp - 1) / tp of the message: more GPUs, more bytes through each link.
    assert tensor_parallel_seconds(sim.cost, H100, 2, DECODE) < tensor_parallel_seconds(sim.cost, H100, 8, DECODE)
    assert tensor_parallel_seconds(sim.cost, H100, 1, DECODE) == 0.0


def test_a_faster_link_makes_the_collectives_cheaper_and_latency_adds_per_collective():
    sim = _simulation("llama3_1_8b_config", 1)
    prefill = dict(DECODE, num_prefill_tokens=4096, num_decode_tokens=0, num_decode_seqs=0, num_sampled=1)
    base = tensor_parallel_seconds(sim.cost, H100, 4, prefill)
    fast = dataclasses.replace(H100, tp_link_bandwidth=2 * H100.tp_link_bandwidth)
    slow_start = dataclasses.replace(H100, tp_link_latency=H100.tp_link_latency + 1e-3)
    assert tensor_parallel_seconds(sim.cost, fast, 4, prefill) < base
    collectives = 2 * sim.cost.num_layers + 1
    assert tensor_parallel_seconds(sim.cost, slow_start, 4, prefill) == pytest.approx(base + collectives * 1e-3)


def test_mfu_and_mbu_are_against_all_the_replicas_gpus():
    sim = _simulation("llama3_1_70b_config", 4)
    monitor = sim.monitor_config(None)
    assert monitor.peak_bandwidth == 4 * H100.memory_bandwidth
    assert monitor.peak_flops == 4 * H100.matmul_peak_flops("bfloat16", False)


def test_hardware_without_a_gpu_link_refuses_tensor_parallelism_by_name():
    no_link = dataclasses.replace(H100, tp_link_bandwidth=None)
    with pytest.raises(ValueError, match="hardware.tp_link_bandwidth"):
        _simulation("llama3_1_70b_config", 4, hardware=no_link)
    _simulation("llama3_1_8b_config", 1, hardware=no_link)   # one GPU needs no link
    with pytest.raises(ValueError, match="tp_link_bandwidth must be > 0"):
        dataclasses.replace(H100, tp_link_bandwidth=-1.0)
