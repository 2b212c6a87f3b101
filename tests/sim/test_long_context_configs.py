"""The shipped architecture configs of long-context models (conf/model/llama3_1_8b_config.yaml,
llama3_1_70b_config.yaml, qwen2_5_7b_config.yaml: public config.json files, no weights) load in the simulator,
carry their 128k context and RoPE scaling, and admit a prompt that Llama-3-8B's 8,192-token context refuses."""

from __future__ import annotations

import json

import pytest
import yaml

from helpers import REPO
from nanovllm.config import EngineConfig
from nanovllm.harness.sim import Hardware, Simulation
from nanovllm.harness.workload import WorkloadRequest

H100 = Hardware(name="h100", peak_flops={"bfloat16": 989e12}, memory_bandwidth=3.35e12, memory_bytes=80e9,
                step_overhead=0.002)
# The 70B's 141 GB of weights need more than one H100: four GPUs' memory and peaks (as one device).
H100_X4 = Hardware(name="h100x4", peak_flops={"bfloat16": 4 * 989e12}, memory_bandwidth=4 * 3.35e12,
                   memory_bytes=4 * 80e9, step_overhead=0.002)
CONFIGS = {  # conf/model name -> (hardware, parameters in billions, layers)
    "llama3_1_8b_config": (H100, 8.03, 32),
    "llama3_1_70b_config": (H100_X4, 70.55, 80),
    "qwen2_5_7b_config": (H100, 7.62, 28),
}


def _model_dir(name: str):
    path = REPO / yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())["path"]
    assert (path / "config.json").is_file()
    return path


def _serve_one(model_dir, hardware: Hardware, prompt_len: int) -> dict:
    sim = Simulation.build(EngineConfig(model=str(model_dir), dtype="bfloat16", max_num_seqs=4), "analytical",
                           hardware=hardware)
    request = WorkloadRequest(arrival_time=0.0, prompt=[10 + i % 1000 for i in range(prompt_len)], max_tokens=2,
                              ignore_eos=True, request_id="0")
    record, = sim.serve([request]).requests
    return {"max_model_len": sim.engine.max_model_len, "params": sim.cost.total_params, "layers": sim.cost.num_layers,
            **record}


def test_llama3_8b_refuses_a_20k_token_prompt_with_its_reason():
    record = _serve_one(_model_dir("llama3_8b_config"), H100, 20_000)
    assert record["max_model_len"] == 8192 and record["num_output_tokens"] == 0
    assert "exceeds max_model_len (8192)" in record["error"]


@pytest.mark.parametrize("name", CONFIGS)
def test_long_context_config_admits_a_20k_token_prompt(name):
    hardware, billions, layers = CONFIGS[name]
    model_dir = _model_dir(name)
    config = json.loads((model_dir / "config.json").read_text())
    if config["model_type"] == "llama":  # Llama 3.1: 8x the 8,192 original positions, rope_type llama3
        assert config["rope_scaling"] == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    record = _serve_one(model_dir, hardware, 20_000)
    assert record["max_model_len"] == 131072
    assert record["params"] / 1e9 == pytest.approx(billions, abs=0.01) and record["layers"] == layers
    assert record["error"] is None and record["num_output_tokens"] == 2 and record["finish_reason"] == "length"
    assert record["first_token_time"] > 0
