"""Fitting a hardware description's efficiencies to Vidur-format operator profiles
(``nanovllm.harness.sim.fit_hardware``), and the shipped A100 description. The profiles are small synthetic files in
Vidur's mlp.csv layout written by the tests from known efficiencies (no measured data): the fit must find them."""

from __future__ import annotations

import csv
import dataclasses

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir

from helpers import REPO
from nanovllm.config import EngineConfig
from nanovllm.harness.conf_schema import register_configs
from nanovllm.harness.run import config_dir
from nanovllm.harness.sim import Hardware, Simulation
from nanovllm.harness.sim.fit_hardware import (LAYER_STEP, Efficiencies, cost_from_profile, errors, fit,
                                               read_operator_times)
from nanovllm.harness.sim.operator_profile import LAYER_OPS
from nanovllm.harness.sim.step_time import AnalyticalStepTime
from nanovllm.harness.workload import WorkloadRequest
from nanovllm.serving.monitor import ModelCost

GPU = Hardware(name="gpu", peak_flops={"float16": 989e12}, memory_bandwidth=3.35e12, memory_bytes=80e9)
COST = ModelCost(hidden_size=1024, intermediate_size=2816, num_layers=4, num_heads=16, num_kv_heads=4, head_dim=64,
                 vocab_size=32000, tie_word_embeddings=False, bytes_per_element=2)
TRUE_MATMUL = Efficiencies(flops_efficiency=0.7, bandwidth_efficiency=0.55)
TRUE_ELEMENTWISE = Efficiencies(flops_efficiency=0.6, bandwidth_efficiency=0.4, kernel_floor=3e-6)
TOKENS = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192]


def _kernel_ms(op: str, tokens: int) -> float:
    """What the analytical roofline gives ``op`` at the true efficiencies, in Vidur's milliseconds."""
    e = TRUE_MATMUL if op in COST.layer_linear_shapes else TRUE_ELEMENTWISE
    model = AnalyticalStepTime(COST, dataclasses.replace(GPU, flops_efficiency=e.flops_efficiency,
                                                         bandwidth_efficiency=e.bandwidth_efficiency), "float16")
    return 1000 * float(model.kernel_seconds(*COST.layer_operator_costs(tokens)[op], e.kernel_floor))


def write_profile(path, ops=LAYER_OPS, gated: bool = True, hidden: int = COST.hidden_size) -> None:
    """Vidur's mlp.csv layout (shape columns, num_tokens, TP degree, time_stats.<op>.median), one-GPU rows."""
    shape = {"n_head": COST.num_heads, "n_kv_head": COST.num_kv_heads, "n_embd": hidden,
             "n_expanded_embd": COST.intermediate_size, "vocab_size": COST.vocab_size, "use_gated_mlp": gated}
    columns = [*(f"time_stats.{op}.median" for op in ops), *shape, "num_tokens", "num_tensor_parallel_workers"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        for n in TOKENS:
            writer.writerow({**shape, "num_tokens": n, "num_tensor_parallel_workers": 1,
                             **{f"time_stats.{op}.median": _kernel_ms(op, n) for op in ops}})


def test_the_fit_recovers_the_efficiencies_a_profile_was_made_with(tmp_path):
    write_profile(tmp_path / "mlp.csv")
    times = read_operator_times(tmp_path / "mlp.csv", COST)
    assert [t.op for t in times] == list(LAYER_OPS) and all(len(t.tokens) == len(TOKENS) for t in times)
    matmuls = [t for t in times if t.op in COST.layer_linear_shapes]
    others = [t for t in times if t.op not in COST.layer_linear_shapes]
    # Started from the hardware's own (wrong) values: 0.6 and 0.8.
    fitted = fit(matmuls, COST, GPU, "float16")
    assert fitted.flops_efficiency == pytest.approx(TRUE_MATMUL.flops_efficiency, rel=1e-3)
    assert fitted.bandwidth_efficiency == pytest.approx(TRUE_MATMUL.bandwidth_efficiency, rel=1e-3)
    assert fitted.kernel_floor == 0.0
    elementwise = fit(others, COST, GPU, "float16", floor=True)
    assert elementwise.bandwidth_efficiency == pytest.approx(TRUE_ELEMENTWISE.bandwidth_efficiency, rel=1e-3)
    assert elementwise.kernel_floor == pytest.approx(TRUE_ELEMENTWISE.kernel_floor, rel=1e-3)

    before = {(r.op, r.tokens): r for r in errors(times, COST, GPU, "float16", Efficiencies(0.6, 0.8))}
    after = {(r.op, r.tokens): r for r in errors(times, COST, GPU, "float16", fitted, elementwise)}
    assert after["all operators", "all"].max_pct < 0.5 < before["all operators", "all"].median_pct
    assert after["all operators", "1-16"].n == 5 * len(LAYER_OPS)
    # The step model prices a layer's linears only: the elementwise kernels it leaves out are its error here.
    assert after[LAYER_STEP, "all"].n == len(TOKENS) and after[LAYER_STEP, "all"].median_pct > 1


def test_per_operator_costs_add_up_to_the_step_models_linears():
    costs = COST.layer_operator_costs(np.asarray([1.0, 512.0]))
    flops = sum(costs[op][0] for op in COST.layer_linear_shapes)
    assert flops.tolist() == [2 * COST.linear_params_per_layer * t for t in (1, 512)]
    weights = sum(n_in * n_out for n_in, n_out in COST.layer_linear_shapes.values())
    assert weights * COST.num_layers == COST.linear_params   # no biases in this model


def test_a_missing_operator_column_is_an_error_naming_the_file_and_column(tmp_path):
    path = tmp_path / "mlp.csv"
    write_profile(path, ops=[op for op in LAYER_OPS if op != "mlp_act"])
    with pytest.raises(ValueError, match=rf"{path}: no time_stats\.mlp_act\.median column"):
        read_operator_times(path, COST)


def test_a_profile_of_another_shape_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "mlp.csv"
    write_profile(path, hidden=2048)
    with pytest.raises(ValueError, match=rf"{path}: no row is of this run's model .*n_embd=1024.*n_embd=2048"):
        read_operator_times(path, COST)


def test_a_held_out_profile_gives_its_own_shape_and_refuses_a_two_matrix_mlp(tmp_path):
    write_profile(tmp_path / "mlp.csv")
    cost = cost_from_profile(tmp_path / "mlp.csv")
    assert cost.layer_linear_shapes == COST.layer_linear_shapes
    write_profile(tmp_path / "phi.csv", gated=False)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'phi.csv'}: use_gated_mlp=False"):
        cost_from_profile(tmp_path / "phi.csv")


def _shipped(name: str) -> Hardware:
    return Hardware.from_config(yaml.safe_load((REPO / "conf" / "hardware" / f"{name}.yaml").read_text()))


def test_a100_composes_and_is_slower_than_h100_by_its_peaks():
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["runner=sim", "runner.step_time=analytical",
                                                       "hardware=a100_sxm", "model=llama3_8b_config"])
    a100, h100 = Hardware.from_config(cfg.hardware), _shipped("h100_sxm")
    assert a100 == _shipped("a100_sxm") and a100.name == "a100_sxm"
    model_dir = REPO / cfg.model.path
    sims = {hw.name: Simulation.build(EngineConfig(model=str(model_dir), dtype="bfloat16", num_kv_blocks=None),
                                      "analytical", hardware=hw) for hw in (a100, h100)}
    decode = {"num_prefill_tokens": 0, "num_decode_tokens": 8, "num_decode_seqs": 8, "num_prefill_seqs": 0,
              "num_sampled": 8, "context_tokens": 8 * 512, "attn_pairs": 8 * 512}
    prefill = {**decode, "num_prefill_tokens": 4096, "num_prefill_seqs": 1, "num_decode_tokens": 0,
               "num_decode_seqs": 0, "num_sampled": 1, "context_tokens": 4096, "attn_pairs": 4096 * 4097 // 2}
    assert all(isinstance(sim.model, AnalyticalStepTime) for sim in sims.values())
    kernel = {name: {kind: sim.model.predict(f, 0.0) - sim.hardware.step_overhead
                     for kind, f in (("decode", decode), ("prefill", prefill))} for name, sim in sims.items()}
    # Decode reads the weights and KV cache (bandwidth bound), a 4,096-token prefill computes (compute bound): the
    # A100 is slower by the ratio of what each reaches.
    assert kernel["a100_sxm"]["decode"] / kernel["h100_sxm"]["decode"] == pytest.approx(
        (h100.memory_bandwidth * h100.bandwidth_efficiency) / (a100.memory_bandwidth * a100.bandwidth_efficiency))
    assert kernel["a100_sxm"]["prefill"] / kernel["h100_sxm"]["prefill"] == pytest.approx(
        (h100.peak_flops["bfloat16"] * h100.flops_efficiency) / (a100.peak_flops["bfloat16"] * a100.flops_efficiency))
    # Both see the same model and the A100 sizes its KV cache around the same weights in its own 80 GiB.
    request = WorkloadRequest(arrival_time=0.0, prompt=[10 + i % 1000 for i in range(300)], max_tokens=4,
                              ignore_eos=True, request_id="0")
    done = {name: sim.serve([request]).requests[0] for name, sim in sims.items()}
    assert done["a100_sxm"]["num_output_tokens"] == done["h100_sxm"]["num_output_tokens"] == 4
    assert done["a100_sxm"]["finish_time"] > done["h100_sxm"]["finish_time"]
