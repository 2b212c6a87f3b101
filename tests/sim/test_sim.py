"""The simulator: the real scheduler, policy and allocator on a virtual clock.

Exactness: replaying a real run's step timeline, the simulator makes the same decisions the real engine made
(same steps, admission order, preemptions, first-token and finish step of every request) for fcfs, priority
and a user policy plugin, with preemptions in the run. Calibration, the analytical model, and bad input.
"""

from __future__ import annotations

import bisect
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from nanovllm import machine
from nanovllm.config import EngineConfig
from nanovllm.harness.runners import check_runner
from nanovllm.harness.serving import serve
from nanovllm.harness.sim import Hardware, Simulation, step_time, this_machine
from nanovllm.harness.sim.calibrate import MIN_STEPS, calibrate, fit_profile
from nanovllm.harness.sim.calibrate import main as calibrate_main
from nanovllm.serving.loggers import JsonlLogger
from nanovllm.serving.monitor import MonitorConfig
from nanovllm.serving.records import RunWriter, read_run
from nanovllm.harness.sim.step_time import (
    CALIBRATION_FEATURES,
    CalibratedStepTime,
    default_profile_path,
    shipped_profile,
    shipped_profiles,
)
from nanovllm.harness.workload import WorkloadRequest

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(num_kv_blocks=10, block_size=16, max_num_seqs=4, max_model_len=128)
# The real and simulated engines must see the same decisions' inputs: every step feature must match.
STEP_DECISIONS = ("num_prefill_tokens", "num_decode_seqs", "num_prefill_seqs", "num_running", "num_waiting",
                  "num_preempted", "kv_blocks_used", "num_sampled", "attn_pairs")


@pytest.fixture(scope="module")
def one_thread():
    # One torch thread: on a small shared machine competing OpenMP threads slow every step tenfold.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def profile_cache(tmp_path, monkeypatch) -> Path:
    """An empty per-machine profile cache of each test's own (``$NANOVLLM_SIM_PROFILES``, inherited by the CLI
    runs too), so a profile calibrated on this machine before (``calibrate --this-machine``) changes nothing."""
    cache = tmp_path / "sim-profiles"
    monkeypatch.setenv(this_machine.PROFILES_ENV, str(cache))
    return cache


def _workload() -> list[WorkloadRequest]:
    """Ten requests arriving over ~0.3 s, long enough together to overflow a 10-block cache (preemptions),
    two priority classes so that the priority policy reorders and preempts."""
    requests = []
    for i in range(10):
        prompt = [100 + (7 * i + j) % 900 for j in range(20 + 6 * (i % 4))]
        requests.append(WorkloadRequest(arrival_time=0.03 * i, prompt=prompt, max_tokens=14 + 3 * (i % 3),
                                        priority=0 if i % 3 == 2 else 1, ignore_eos=True))
    return requests


def _step_of(starts: list[float], t: float) -> int:
    """The step during which something at time ``t`` happened (the last step that started before it)."""
    return bisect.bisect_left(starts, t) - 1


def _decisions(run) -> dict:
    steps = run.steps
    starts = [s["start_time"] for s in steps]
    requests = sorted(run.requests, key=lambda r: (r["first_scheduled_time"], r["request_id"]))
    return {
        "steps": [{k: s[k] for k in STEP_DECISIONS} for s in steps],
        "admission_order": [r["request_id"] for r in requests],
        "per_request": {r["request_id"]: (r["num_preemptions"], r["num_output_tokens"], r["finish_reason"],
                                          _step_of(starts, r["first_token_time"]), _step_of(starts, r["finish_time"]))
                        for r in run.requests},
    }


@pytest.mark.parametrize("policy", ["fcfs", "priority", "shortest_prompt_first"])
def test_replay_makes_the_real_engines_scheduling_decisions(llm, one_thread, tmp_path, policy) -> None:
    from nanovllm import LLM

    scheduler = {"name": policy, "max_wait": 0.2} if policy == "shortest_prompt_first" else policy
    # The user's policy file, loaded by LLM itself as python -m nanovllm.run plugins=[...] loads it.
    engine = LLM(scheduler=scheduler, plugins=[str(ROOT / "experiments" / "my_policy.py")], **ENGINE).engine
    logger = JsonlLogger()
    logger.start(tmp_path, {})
    real = serve(engine, _workload(), progress=False, loggers=[logger])
    logger.finish()
    assert sum(r["num_preemptions"] for r in real.requests) > 0, "the run must exercise preemption"

    sim = Simulation.build(EngineConfig(**ENGINE), "replay", scheduler=scheduler, replay_run=str(tmp_path))
    simulated = sim.serve(_workload())

    recorded = read_run(tmp_path)
    assert _decisions(simulated) == _decisions(recorded)
    assert simulated.summary["simulated"] is True and simulated.summary["step_time_model"] == "replay"
    assert set(simulated.summary) == set(real.summary) | {"simulated", "step_time_model"}
    # Simulated time is the recorded time: the same steps start at the same moments.
    np.testing.assert_allclose([s["start_time"] for s in simulated.steps[1:]],
                               [s["start_time"] for s in recorded.steps[1:]], rtol=0, atol=1e-9)


def _synthetic_steps(n: int, rng: np.random.Generator) -> list[dict]:
    steps = []
    for _ in range(n):
        # Half the steps are decode-only, as in a real run, so the intercept and the sampled rows separate.
        prefill = int(rng.integers(1, 300)) if rng.random() < 0.5 else 0
        decode = int(rng.integers(0, 16))
        context = prefill + decode * int(rng.integers(10, 400))
        steps.append({"num_prefill_tokens": prefill, "num_decode_seqs": decode, "num_sampled": decode + (prefill > 0),
                      "context_tokens": context, "attn_pairs": prefill * prefill // 2 + context})
    return steps


def test_calibration_recovers_the_cost_of_each_feature() -> None:
    rng = np.random.default_rng(0)
    truth = {"num_prefill_tokens": 4e-4, "num_decode_seqs": 2e-3, "num_sampled": 1e-3, "context_tokens": 1e-6,
             "attn_pairs": 3e-8}
    steps = _synthetic_steps(200, rng)
    for step in steps:
        step["duration"] = 0.01 + sum(c * step[f] for f, c in truth.items())
    profile = fit_profile(steps)
    assert profile["intercept"] == pytest.approx(0.01, rel=1e-3)
    for feature in CALIBRATION_FEATURES:
        assert profile["coefficients"][feature] == pytest.approx(truth[feature], rel=1e-3)
    assert profile["fit"]["r2"] > 0.999
    assert profile["feature_range"]["num_decode_seqs"][1] <= 15


def test_calibration_refuses_too_few_steps_and_a_feature_that_never_varies() -> None:
    steps = _synthetic_steps(MIN_STEPS - 1, np.random.default_rng(1))
    for step in steps:
        step["duration"] = 0.1
    with pytest.raises(ValueError, match=f"at least {MIN_STEPS} steps"):
        fit_profile(steps)
    decode_only = [{**s, "num_prefill_tokens": 0} for s in _synthetic_steps(100, np.random.default_rng(2))]
    for step in decode_only:
        step["duration"] = 0.1
    with pytest.raises(ValueError, match="num_prefill_tokens is 0 in every step"):
        fit_profile(decode_only)


def _kernel_timed_steps(n: int, seed: int, switch: int = 2) -> list[dict]:
    """Steps timed like the bfloat16 CPU engine's: rows (prefill tokens + decode sequences) up to ``switch`` go
    through the GEMV kernel at 2.5 ms a row, more rows through the GEMM at a fixed 9 ms plus 0.5 ms a sampled row."""
    steps = _synthetic_steps(n, np.random.default_rng(seed))
    for step in steps:
        rows = step["num_prefill_tokens"] + step["num_decode_seqs"]
        kernel = 2.5e-3 * rows if rows <= switch else 9e-3 + 5e-4 * step["num_sampled"]
        step["duration"] = 0.018 + kernel + 1e-3 * step["num_prefill_tokens"]
    return steps


def test_calibration_fits_each_matmul_kernel_and_predicts_across_the_switch(tmp_path) -> None:
    steps = _kernel_timed_steps(300, 7)
    profile = fit_profile(steps, gemv_max_rows=2)
    assert profile["gemv_max_rows"] == 2
    # (Per-row costs of the two kernels trade off against the sampled-row cost, so only the fit is checked.)
    assert profile["coefficients"]["gemm_step"] > 0 and profile["fit"]["p90_abs_rel_error"] < 1e-3
    # A rows-linear fit of the same steps cannot follow the switch.
    assert fit_profile(steps)["fit"]["p90_abs_rel_error"] > 0.05
    (tmp_path / "kernels.yaml").write_text(yaml.safe_dump(profile))
    model = CalibratedStepTime(profile=str(tmp_path / "kernels.yaml"), dtype="bfloat16")
    decode = {"num_prefill_tokens": 0, "num_decode_seqs": 2, "num_sampled": 2, "context_tokens": 300,
              "attn_pairs": 300}
    assert model.predict(decode, 0.0) == pytest.approx(0.018 + 2 * 2.5e-3, rel=1e-3)
    three = {**decode, "num_decode_seqs": 3, "num_sampled": 3}
    assert model.predict(three, 0.0) == pytest.approx(0.018 + 9e-3 + 3 * 5e-4, rel=1e-3)


def test_a_clusters_gaps_are_between_each_replicas_own_steps() -> None:
    """Two replicas stepping at once interleave in steps.jsonl: 0.4 ms between a replica's own steps, while the
    file's neighbours (the other replica's steps) overlap them."""
    from nanovllm.harness.sim.calibrate import step_gaps

    steps = []
    for replica, offset in ((0, 0.0), (1, 0.005)):
        t = offset
        for i in range(20):
            steps.append(dict(step=i, replica=replica, start_time=t, duration=0.01, num_running=1, num_waiting=0))
            t += 0.01 + 4e-4
    steps.sort(key=lambda s: s["start_time"])
    gaps = step_gaps(steps)
    assert len(gaps) == 38 and gaps == pytest.approx([4e-4] * 38, rel=1e-6)


def test_calibration_measures_the_loops_time_between_steps(tmp_path) -> None:
    steps = _timed_steps(60, 8, 2e-4)
    t = 0.0
    for i, step in enumerate(steps):
        # Back-to-back steps 0.4 ms apart; after step 29 the engine is empty and idles 2 s for an arrival.
        idle = i == 29
        step.update(step=i, start_time=t, num_running=0 if idle else 1, num_waiting=0)
        t += step["duration"] + (2.0 if idle else 4e-4)
    bf16 = _run_dir(tmp_path / "run", "bfloat16", steps)
    profile = calibrate([bf16], tmp_path / "gap.yaml")
    assert profile["step_gap"] == pytest.approx(4e-4, rel=1e-6)
    # bfloat16 runs on CPU fit the engine's GEMV/GEMM switch; float32 runs have none to fit.
    from nanovllm.models.fast_path import PackedLinear

    assert profile["gemv_max_rows"] == PackedLinear.GEMV_MAX_ROWS
    fp32 = calibrate([_run_dir(tmp_path / "fp32", "float32", steps)], tmp_path / "fp32.yaml")
    assert "gemv_max_rows" not in fp32 and "gemv_rows" not in fp32["coefficients"]
    model = CalibratedStepTime(profile=str(tmp_path / "gap.yaml"), dtype="bfloat16")
    step = steps[3]
    assert model.predict(step, 0.0) == pytest.approx(step["duration"] + 4e-4, rel=1e-3)


def test_bf16_runs_on_amx_fit_their_kernel_switch_rather_than_take_the_gemv_one() -> None:
    # On AMX bf16 linears run through brgemm at every row count: the GEMV switch is not the engine's there.
    from nanovllm.harness.sim.calibrate import default_gemv_max_rows
    from nanovllm.models.fast_path import PackedLinear

    bf16 = [{"device": "cpu", "dtype": "bfloat16"}]
    assert default_gemv_max_rows(bf16, [{"isa": "avx512_bf16"}]) == PackedLinear.GEMV_MAX_ROWS
    assert default_gemv_max_rows(bf16, [{"isa": "avx512_bf16"}, {"isa": "amx"}]) == "fit"
    assert default_gemv_max_rows(bf16, [{"isa": "amx"}]) == "fit"
    assert default_gemv_max_rows(bf16, [None]) == PackedLinear.GEMV_MAX_ROWS
    # The shipped bf16 profiles were fit on AVX-512 without BF16 with the fixed switch: it stays so there.
    assert default_gemv_max_rows(bf16, [{"isa": "avx512"}]) == PackedLinear.GEMV_MAX_ROWS
    assert default_gemv_max_rows([{"device": "cpu", "dtype": "float32"}], [{"isa": "avx512"}]) == "fit"
    assert default_gemv_max_rows([{"device": "cuda", "dtype": "bfloat16"}], [{"isa": "amx"}]) is None
    # Quantized linears are int8 kernels with no GEMV switch of the engine's: found from the steps.
    int8 = [{"device": "cpu", "dtype": "bfloat16", "quantization": "int8"}]
    assert default_gemv_max_rows(int8, [{"isa": "avx512_bf16"}]) == "fit"


def _noisy(steps: list[dict], seed: int) -> list[dict]:
    """The steps with 1% measurement noise on every duration, as real steps have."""
    rng = np.random.default_rng(seed)
    return [{**step, "duration": step["duration"] * (1 + 0.01 * rng.standard_normal())} for step in steps]


def test_calibration_finds_a_kernel_switch_from_the_steps_where_the_engine_declares_none(tmp_path) -> None:
    # In float32 oneDNN picks its matmul kernel by row count itself: the switch is found from the steps.
    steps = _noisy(_kernel_timed_steps(300, 7, switch=3), 11)
    profile = calibrate([_run_dir(tmp_path / "switch", "float32", steps)], tmp_path / "switch.yaml")
    assert (profile["gemv_max_rows"], profile["kernel_switch"]) == (3, "fitted from the steps")
    assert profile["fit"]["p90_abs_rel_error"] < 0.03
    model = CalibratedStepTime(profile=str(tmp_path / "switch.yaml"), dtype="float32")
    three = {"num_prefill_tokens": 0, "num_decode_seqs": 3, "num_sampled": 3, "context_tokens": 300,
             "attn_pairs": 300}
    assert model.predict(three, 0.0) == pytest.approx(0.018 + 3 * 2.5e-3, rel=0.03)
    four = {**three, "num_decode_seqs": 4, "num_sampled": 4}
    assert model.predict(four, 0.0) == pytest.approx(0.018 + 9e-3 + 4 * 5e-4, rel=0.03)
    # Steps linear in the rows get no switch: the two extra terms would only fit the noise.
    linear = _noisy(_timed_steps(300, 9, 5e-4), 12)
    profile = calibrate([_run_dir(tmp_path / "linear", "float32", linear)], tmp_path / "linear.yaml")
    assert "gemv_max_rows" not in profile and profile["kernel_switch"] == "none (BIC)"


def test_calibration_fits_a_bend_where_the_steps_have_one_and_none_where_they_do_not(tmp_path) -> None:
    # Steps bound by reading the weights up to 48 rows (one cost whatever their rows), compute past it.
    steps = _synthetic_steps(300, np.random.default_rng(5))
    for step in steps:
        rows = step["num_prefill_tokens"] + step["num_decode_seqs"]
        step["duration"] = 0.02 + 1e-6 * step["context_tokens"] + 4e-4 * max(0, rows - 48)
    steps = _noisy(steps, 13)
    profile = calibrate([_run_dir(tmp_path / "bent", "float32", steps)], tmp_path / "bent.yaml", knee_rows="fit",
                        gemv_max_rows=0)
    assert (profile["knee_rows"], profile["knee"]) == (48, "fitted from the steps")
    assert profile["coefficients"]["rows_above_knee"] == pytest.approx(4e-4, rel=0.05)
    model = CalibratedStepTime(profile=str(tmp_path / "bent.yaml"), dtype="float32")
    few = {"num_prefill_tokens": 30, "num_decode_seqs": 2, "num_sampled": 3, "context_tokens": 100, "attn_pairs": 500}
    assert model.predict(few, 0.0) == pytest.approx(0.02 + 1e-4, rel=0.05)
    # Without the bend the same steps are priced with a rows-linear slope from the first row on.
    assert fit_profile(steps)["fit"]["p90_abs_rel_error"] > 2 * profile["fit"]["p90_abs_rel_error"]
    linear = _noisy(_timed_steps(300, 9, 5e-4), 12)
    profile = calibrate([_run_dir(tmp_path / "linear", "float32", linear)], tmp_path / "linear.yaml",
                        knee_rows="fit", gemv_max_rows=0)
    assert "knee_rows" not in profile and profile["knee"] == "none (BIC)"


def test_calibrate_cli_refuses_a_negative_kernel_switch(tmp_path, capsys) -> None:
    # The CLI's main in this process: its argument checks are the same, without a second Python importing torch
    # (test_sim_speculation runs the module as ``python -m``).
    with pytest.raises(SystemExit) as exited:
        calibrate_main([str(tmp_path), "--out", str(tmp_path / "p.yaml"), "--gemv-max-rows", "-1"])
    assert exited.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == ["error: --gemv-max-rows must be >= 0, got -1"]
    with pytest.raises(SystemExit):
        calibrate_main([str(tmp_path), "--out", str(tmp_path / "p.yaml"), "--knee-rows", "bent"])
    assert capsys.readouterr().err.strip() == "error: --knee-rows must be a row count >= 0 or 'fit', got 'bent'"


def _h100() -> Hardware:
    return Hardware(name="h100", peak_flops={"bfloat16": 989e12}, memory_bandwidth=3.35e12, memory_bytes=80e9,
                    step_overhead=0.002)


def test_analytical_model_is_a_roofline_and_sizes_the_kv_cache_from_memory(tokenizer) -> None:
    sim = Simulation.build(EngineConfig(dtype="bfloat16", max_num_seqs=64), "analytical", hardware=_h100())
    cost = sim.cost
    # The KV cache is what 90% of 80 GB leaves after the weights, in blocks (capped at what 64 seqs can use).
    kv_bytes = 0.9 * 80e9 - cost.total_params * cost.bytes_per_element
    block_bytes = cost.kv_bytes_per_token * 16
    assert sim.engine.num_kv_blocks == min(int(kv_bytes) // block_bytes,
                                           64 * -(-sim.engine.max_model_len // 16))
    model = sim.model
    decode = {"num_prefill_tokens": 0, "num_decode_tokens": 1, "num_decode_seqs": 1, "num_sampled": 1,
              "context_tokens": 100, "attn_pairs": 100}
    # One decode is memory bound: the weights stream once at 80% of the bandwidth.
    assert model.predict(decode, 0.0) == pytest.approx(0.002 + cost.step_bytes(decode) / (0.8 * 3.35e12))
    prefill = {**decode, "num_prefill_tokens": 8192, "num_decode_tokens": 0, "num_decode_seqs": 0,
               "context_tokens": 8192, "attn_pairs": 8192 * 8193 // 2}
    assert model.predict(prefill, 0.0) == pytest.approx(0.002 + cost.step_flops(prefill) / (0.6 * 989e12))


def test_quantized_weights_on_hardware_stream_as_stored_and_multiply_at_the_int8_peak(tokenizer) -> None:
    """engine.quantization on an analytical run: Llama-3-8B's int8 weights leave the KV cache more of an H100,
    a decode step streams them as stored (about half the bf16 bytes), a prefill runs its linears at the int8
    peak and attention at bf16's, and MFU is measured against the int8 peak."""
    llama3 = str(ROOT / "nanovllm/data/models/llama-3-8b")
    h100 = Hardware(name="h100", peak_flops={"bfloat16": 989e12, "int8": 1979e12}, memory_bandwidth=3.35e12,
                    memory_bytes=80e9, step_overhead=0.002)
    dense, int8 = (Simulation.build(EngineConfig(model=llama3, dtype="bfloat16", quantization=quantization,
                                                 max_num_seqs=512, max_model_len=8192), "analytical", hardware=h100)
                   for quantization in (None, "int8"))
    cost = int8.cost
    assert cost.int8_matmuls and not dense.cost.int8_matmuls
    # Codes and a float32 scale per output channel for every linear and the head; the embedding stays bf16.
    assert cost.weight_bytes == pytest.approx(dense.cost.weight_bytes / 2, rel=0.01)
    embedding = cost.vocab_size * cost.hidden_size * 2
    assert cost.weight_memory_bytes == pytest.approx(cost.weight_bytes + embedding, rel=0.001)
    assert int8.engine.num_kv_blocks == int(0.9 * 80e9 - cost.weight_memory_bytes) // (cost.kv_bytes_per_token * 16)
    assert int8.engine.num_kv_blocks > 1.1 * dense.engine.num_kv_blocks
    decode = {"num_prefill_tokens": 0, "num_decode_tokens": 1, "num_decode_seqs": 1, "num_sampled": 1,
              "context_tokens": 100, "attn_pairs": 100}
    assert int8.model.predict(decode, 0.0) == pytest.approx(0.002 + cost.step_bytes(decode) / (0.8 * 3.35e12))
    assert int8.model.predict(decode, 0.0) - 0.002 == pytest.approx((dense.model.predict(decode, 0.0) - 0.002) / 2,
                                                                    rel=0.02)
    prefill = {**decode, "num_prefill_tokens": 8192, "num_decode_tokens": 0, "num_decode_seqs": 0,
               "context_tokens": 8192, "attn_pairs": 8192 * 8193 // 2}
    assert int8.model.predict(prefill, 0.0) == pytest.approx(
        0.002 + cost.step_matmul_flops(prefill) / (0.6 * 1979e12) + cost.step_attention_flops(prefill) / (0.6 * 989e12))
    assert int8.monitor_config(MonitorConfig()).peak_flops == 1979e12
    assert dense.monitor_config(MonitorConfig()).peak_flops == 989e12
    # Hardware that gives no int8 peak is an error naming the field, not a silent bf16 estimate.
    with pytest.raises(ValueError, match="hardware.peak_flops has no int8 entry.*engine.quantization"):
        Simulation.build(EngineConfig(model=llama3, dtype="bfloat16", quantization="int8"), "analytical",
                         hardware=_h100())


def test_hardware_without_memory_for_the_weights_names_the_field() -> None:
    small = Hardware(name="tiny", peak_flops={"float32": 1e12}, memory_bandwidth=1e11, memory_bytes=1e8)
    with pytest.raises(ValueError, match=r"hardware.memory_bytes: tiny has .* weights need"):
        Simulation.build(EngineConfig(), "analytical", hardware=small)
    with pytest.raises(ValueError, match="hardware.memory_bandwidth must be > 0"):
        Hardware.from_config({"name": "x", "peak_flops": {"float32": 1e12}, "memory_bytes": 1e9})
    with pytest.raises(ValueError, match="hardware: unknown key"):
        Hardware.from_config({"name": "x", "bandwith": 1})


def test_check_runner_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="runner.step_time: unknown step-time model 'calibrate'.*calibrated"):
        check_runner({"name": "sim", "step_time": "calibrate"}, None)
    with pytest.raises(ValueError, match="hardware is not set"):
        check_runner({"name": "sim", "step_time": "analytical"}, None)
    with pytest.raises(ValueError, match="runner.name must be one of http, real, sim, tp"):
        check_runner({"name": "simulated"}, None)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanovllm.run", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_cli_simulates_many_requests_and_writes_the_run_files(tmp_path) -> None:
    run_dir = tmp_path / "run"
    # float32: the calibrated model's default profile is the shipped one for the engine's dtype.
    proc = _cli("runner=sim", "engine.dtype=float32", "workload=synthetic", "workload.num_requests=2000",
                "workload.request_rate=40", "workload.input_len.mean=64", "workload.output_len.kind=fixed",
                "workload.output_len.mean=16", "scheduler=priority",
                "engine.max_num_seqs=32", "engine.num_kv_blocks=256", "monitor.calibrate=false",
                "progress=false", f"hydra.run.dir={run_dir}", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    run = read_run(run_dir, missing_ok=False)
    assert run.metrics["simulated"] is True
    assert run.metrics["step_time_model"] == "calibrated:smollm2-135m-float32-cpu.yaml"
    assert run.metrics["completed"] == 2000 and len(run.requests) == 2000
    assert all(r["num_output_tokens"] == 16 for r in run.requests)
    # Virtual time: the steps tile the run with no gaps while the engine is busy, and never overlap.
    ends = [s["start_time"] + s["duration"] for s in run.steps]
    assert all(s["start_time"] >= e - 1e-9 for s, e in zip(run.steps[1:], ends))


def test_cli_bad_step_time_model_is_one_error_line(tmp_path) -> None:
    proc = _cli("runner=sim", "runner.step_time=wallclock", f"hydra.run.dir={tmp_path}", cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: runner.step_time: unknown step-time model 'wallclock'. Registered step-time model names: "
        "analytical, calibrated, profiled, replay, token_cost."]


def _run_dir(path: Path, dtype: str, steps: list[dict]) -> Path:
    """A real run's directory as the harness writes it: its config and steps (durations set by the test)."""
    writer = RunWriter(path, config={"model": {"path": None}, "engine": {"dtype": dtype},
                                     "attention": {"name": "cpu"}})
    for step in steps:
        writer.write_step(step)
    writer.write_metrics({"simulated": False})
    writer.close()
    return path


def _timed_steps(n: int, seed: int, per_prefill_token: float) -> list[dict]:
    steps = _synthetic_steps(n, np.random.default_rng(seed))
    for step in steps:
        step["duration"] = 0.01 + per_prefill_token * step["num_prefill_tokens"] + 1e-3 * step["num_decode_seqs"]
    return steps


def test_profile_records_the_runs_dtype_and_the_simulator_keeps_to_it(tmp_path) -> None:
    bf16 = [_run_dir(tmp_path / f"bf16_{i}", "bfloat16", _timed_steps(60, i, 2e-4)) for i in range(2)]
    profile = calibrate(bf16, tmp_path / "bf16.yaml")
    assert (profile["model"], profile["dtype"], profile["attention"]) == (None, "bfloat16", "cpu")
    assert profile["coefficients"]["num_prefill_tokens"] == pytest.approx(2e-4, rel=1e-3)
    assert calibrate(bf16, tmp_path / "bf16.yaml") == profile  # what was written reads back the same

    fp32 = _run_dir(tmp_path / "fp32", "float32", _timed_steps(60, 3, 5e-4))
    with pytest.raises(ValueError, match=r"runs use different engine.dtype \(bfloat16, float32\)"):
        calibrate([*bf16, fp32], tmp_path / "mixed.yaml")

    model = CalibratedStepTime(profile=str(tmp_path / "bf16.yaml"), dtype="bfloat16")
    features = {"num_prefill_tokens": 100, "num_decode_seqs": 4, "num_sampled": 5, "context_tokens": 300,
                "attn_pairs": 5000}
    assert model.predict(features, 0.0) == pytest.approx(0.01 + 2e-4 * 100 + 1e-3 * 4, rel=1e-3)
    with pytest.raises(ValueError, match=r"runner.profile: bf16.yaml was calibrated with engine.dtype=bfloat16, "
                                         r"but this run uses engine.dtype=float32"):
        CalibratedStepTime(profile=str(tmp_path / "bf16.yaml"), dtype="float32")
    # A profile that does not say its dtype (fitted from Python) is taken as given.
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(fit_profile(_timed_steps(60, 4, 2e-4))))
    assert CalibratedStepTime(profile=str(tmp_path / "plain.yaml"), dtype="float32").predict(features, 0.0) > 0


def test_default_profile_is_the_shipped_one_for_the_engines_dtype(tmp_path, monkeypatch) -> None:
    # The shipped float32 profile is chosen for float32 and says so.
    assert shipped_profile("float32") == default_profile_path("float32")
    assert yaml.safe_load(default_profile_path("float32").read_text())["dtype"] == "float32"
    assert CalibratedStepTime(dtype="float32").describe() == "calibrated:smollm2-135m-float32-cpu.yaml"
    # Which dtypes have a shipped profile changes with calibration: a profiles directory of the test's own.
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "smollm2-135m-bfloat16-cpu.yaml").write_text(
        yaml.safe_dump({"dtype": "bfloat16", **fit_profile(_timed_steps(60, 5, 2e-4))}))
    monkeypatch.setattr(step_time, "PROFILES_DIR", profiles)
    assert shipped_profiles() == {"bfloat16": profiles / "smollm2-135m-bfloat16-cpu.yaml"}
    assert CalibratedStepTime(dtype="bfloat16").describe() == "calibrated:smollm2-135m-bfloat16-cpu.yaml"
    with pytest.raises(ValueError, match=r"^runner.profile: no calibration profile is shipped for the default model "
                                         r"in engine.dtype=float32 \(shipped: bfloat16\); pass runner.profile=FILE"):
        CalibratedStepTime(dtype="float32")
    with pytest.raises(ValueError, match=r"^runner.profile: no calibration profile is shipped for model '/m' "
                                         r"\(only for the default model, SmolLM2-135M\); pass runner.profile=FILE"):
        CalibratedStepTime(dtype="bfloat16", model="/m")


def test_cli_no_shipped_profile_for_the_model_is_one_error_line(tmp_path) -> None:
    proc = _cli("runner=sim", f"model.path={ROOT / 'nanovllm/data/models/llama-3-8b'}", f"hydra.run.dir={tmp_path}",
                cwd=ROOT)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: runner.profile: no calibration profile is shipped for "
                                                   "model"), proc.stderr
    assert "runner.profile=FILE" in lines[0]


def test_an_architecture_without_weights_or_tokenizer_is_simulated_on_hardware() -> None:
    """Llama-3-8B's config alone, on an H100: the KV cache is what the 16 GB of bf16 weights leave of 72 GB,
    prompts use the default tokenizer, and requests run to their target lengths."""
    sim = Simulation.build(EngineConfig(model=str(ROOT / "nanovllm/data/models/llama-3-8b"), dtype="bfloat16",
                                        max_num_seqs=512, max_model_len=8192), "analytical", hardware=_h100())
    cost = sim.cost
    assert cost.total_params == pytest.approx(8.03e9, rel=0.01)
    kv_tokens = (0.9 * 80e9 - cost.total_params * 2) / cost.kv_bytes_per_token  # 128 KiB of KV per token
    assert sim.engine.num_kv_blocks == int(0.9 * 80e9 - cost.total_params * 2) // (cost.kv_bytes_per_token * 16)
    assert kv_tokens == pytest.approx(427_000, rel=0.01)
    workload = [WorkloadRequest(arrival_time=0.01 * i, prompt=list(range(1, 200)), max_tokens=50, ignore_eos=True)
                for i in range(20)]
    result = sim.serve(workload)
    assert result.summary["completed"] == 20 and result.summary["total_output_tokens"] == 20 * 50


# -- which machine a profile describes (issue 22) ------------------------------------------------------------------

def _profile_on(machine_info: dict | None, dtype: str = "bfloat16") -> dict:
    profile = {"dtype": dtype, **fit_profile(_timed_steps(60, 5, 2e-4))}
    if machine_info is not None:
        profile["machine"] = machine_info
    return profile


def _warnings(caplog, **build) -> list[str]:
    """The warnings logged while a calibrated simulation is built (what ``runner=sim`` prints and logs)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Simulation.build(EngineConfig(dtype="bfloat16", num_kv_blocks=64), "calibrated", **build)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_profile_of_another_machine_says_so_in_one_line_naming_the_calibrate_command(tmp_path, caplog) -> None:
    here = machine.describe(bandwidth=False)
    other = {**here, "cpu": "AMD EPYC 9B14 96-Core Processor", "isa": "avx512_bf16"}
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump(_profile_on(other)))
    lines = _warnings(caplog, profile=str(path))
    assert len(lines) == 1 and "\n" not in lines[0], lines
    command = f"python -m nanovllm.harness.sim.calibrate --this-machine --dtype bfloat16 --threads {here['threads']}"
    assert lines[0].startswith(f"runner=sim: step-time profile {path} was measured on AMD EPYC 9B14 96-Core "
                               "Processor (avx512_bf16, ")
    assert f"this machine, {here['cpu']} ({here['isa']}, {here['threads']} thread" in lines[0]
    assert f"`{command}`" in lines[0]
    # Another ISA level alone (a CPU of the same name without the extension, a NANOVLLM_CPU_ISA-capped run) or
    # another torch thread count is another machine too.
    for differs in ({"isa": "amx" if here["isa"] != "amx" else "avx2"}, {"threads": here["threads"] + 1}):
        path.write_text(yaml.safe_dump(_profile_on({**here, **differs})))
        assert len(_warnings(caplog, profile=str(path))) == 1
    # The shipped profiles record the machine they were measured on, and on any other one a default run says so.
    for dtype in ("bfloat16", "float32"):
        shipped = yaml.safe_load(default_profile_path(dtype).read_text())["machine"]
        assert set(this_machine.MACHINE_KEYS) <= set(shipped) and shipped["cpu"]
    shipped = yaml.safe_load(default_profile_path("bfloat16").read_text())["machine"]
    lines = _warnings(caplog)
    if (shipped["cpu"], shipped["isa"], shipped["threads"]) != (here["cpu"], here["isa"], here["threads"]):
        assert len(lines) == 1, lines
        assert f"smollm2-135m-bfloat16-cpu.yaml (shipped) was measured on {shipped['cpu']}" in lines[0]
        assert command in lines[0]
    else:  # the machine the shipped profile was measured on (CI's kind, with the suite's one thread)
        assert lines == []


def test_a_profile_of_this_machine_or_of_no_recorded_machine_says_nothing(tmp_path, caplog) -> None:
    path = tmp_path / "here.yaml"
    path.write_text(yaml.safe_dump(_profile_on(machine.describe(bandwidth=False))))
    assert _warnings(caplog, profile=str(path)) == []
    path.write_text(yaml.safe_dump(_profile_on(None)))  # fitted from Python: no machine to compare
    assert _warnings(caplog, profile=str(path)) == []


def test_this_machines_cached_profile_is_preferred_over_the_shipped_one(tmp_path, monkeypatch, caplog) -> None:
    # The cache lives under cache_root() ($NANOVLLM_CACHE) unless $NANOVLLM_SIM_PROFILES points elsewhere.
    with monkeypatch.context() as env:
        env.delenv(this_machine.PROFILES_ENV)
        env.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
        assert CalibratedStepTime(dtype="bfloat16").path == default_profile_path("bfloat16")
        here = this_machine.this_machine()
        cached = this_machine.cached_profile_path("bfloat16")
        assert cached == (tmp_path / "cache" / "sim-profiles" / this_machine.machine_key(here)
                          / "smollm2-135m-bfloat16-cpu.yaml")
        assert cached.parent.name.endswith(f"_{here['isa']}_{here['threads']}t")
        cached.parent.mkdir(parents=True)
        cached.write_text(yaml.safe_dump(_profile_on(machine.describe(bandwidth=False))))
        model = CalibratedStepTime(dtype="bfloat16")
        assert model.path == cached and model.describe() == f"calibrated:{cached.parent.name}/{cached.name}"
        assert model.machine_warning() is None
        assert CalibratedStepTime(dtype="float32").path == default_profile_path("float32")  # one file per dtype
        # An explicit runner.profile still wins.
        explicit = tmp_path / "explicit.yaml"
        explicit.write_text(yaml.safe_dump(_profile_on(None)))
        assert CalibratedStepTime(profile=str(explicit), dtype="bfloat16").path == explicit
    # Through a whole simulated engine (the model from the usual cache, the profile from a cache of the test's).
    cached = this_machine.cached_profile_path("bfloat16")
    cached.parent.mkdir(parents=True)
    cached.write_text(yaml.safe_dump(_profile_on(machine.describe(bandwidth=False))))
    assert _warnings(caplog) == []
    # Cached for this thread count only: with another, the shipped one is used, and a line on a profile of this
    # CPU at another thread count says which thread count is cached.
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert CalibratedStepTime(dtype="bfloat16").path == default_profile_path("bfloat16")
    finally:
        torch.set_num_threads(threads)
    other_threads = {**machine.describe(bandwidth=False), "threads": threads + 1}
    line = this_machine.mismatch(_profile_on(machine.describe(bandwidth=False)), "p.yaml", "bfloat16", other_threads)
    assert line.endswith(f"(this CPU has a cached profile for {threads} thread(s): OMP_NUM_THREADS={threads} uses it)")


def test_a_quantized_or_8bit_kv_run_takes_this_machines_profile_of_its_own_settings(tmp_path, monkeypatch,
                                                                                     caplog) -> None:
    """calibrate --this-machine --quantization/--kv-cache-dtype caches one profile per setting; a simulated run
    takes the one of its weights and KV cache, else the dense one with a warning naming the command that
    calibrates its settings."""
    monkeypatch.setenv(this_machine.PROFILES_ENV, str(tmp_path))
    here = machine.describe(bandwidth=False)
    int8 = this_machine.cached_profile_path("bfloat16", quantization="int8")
    assert int8.name == "smollm2-135m-bfloat16-int8-cpu.yaml"
    assert this_machine.profile_name("bfloat16", "int8", "fp8_e4m3") == "smollm2-135m-bfloat16-int8-kv-fp8_e4m3-cpu.yaml"
    assert this_machine.profile_name("float32", kv_cache_dtype="int8") == "smollm2-135m-float32-kv-int8-cpu.yaml"
    dense = this_machine.cached_profile_path("bfloat16")
    dense.parent.mkdir(parents=True)
    dense.write_text(yaml.safe_dump(_profile_on(here)))
    # Only a dense profile: an int8 run uses it, and says which command calibrates int8's.
    model = CalibratedStepTime(dtype="bfloat16", quantization="int8")
    assert model.path == dense
    command = (f"python -m nanovllm.harness.sim.calibrate --this-machine --dtype bfloat16 --threads "
               f"{torch.get_num_threads()} --quantization int8")
    assert "engine.quantization=none, this run uses int8" in model.quantization_warning()
    assert f"`{command}`" in model.quantization_warning()
    int8.write_text(yaml.safe_dump({**_profile_on(here), "quantization": "int8"}))
    model = CalibratedStepTime(dtype="bfloat16", quantization="int8")
    assert model.path == int8 and model.quantization_warning() is None and model.kv_cache_warning() is None
    # The int8-weights profile is not an 8-bit-KV one: that run falls back to the dense profile and says so.
    kv8 = CalibratedStepTime(dtype="bfloat16", quantization="int8", kv_cache_dtype="int8")
    assert kv8.path == dense and f"`{command} --kv-cache-dtype int8`" in kv8.kv_cache_warning()
    assert CalibratedStepTime(dtype="bfloat16").path == dense
    assert _warnings(caplog) == []


def test_calibrate_this_machine_refuses_settings_the_engine_does_not_take(tmp_path, capsys) -> None:
    from nanovllm.harness.sim.calibrate import main

    for args, message in [(["--quantization", "awq"], "--quantization must be one of int8, gguf, got 'awq'"),
                          (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype must be one of auto, int8, fp8_e4m3, "
                                                        "got 'fp4'")]:
        with pytest.raises(SystemExit) as exited:
            main(["--this-machine", "--out", str(tmp_path / "p.yaml"), *args])
        assert exited.value.code == 1
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    assert not list(tmp_path.iterdir())  # refused before any run


def test_calibrate_writes_the_machine_of_the_runs(tmp_path) -> None:
    recorded = {"cpu": "Some CPU 9000", "arch": "x86_64", "isa": "avx2", "threads": 4}

    def run_on(name: str, seed: int, info: dict | None) -> Path:
        run_dir = _run_dir(tmp_path / name, "bfloat16", _timed_steps(60, seed, 2e-4))
        if info is not None:
            metrics = json.loads((run_dir / "metrics.json").read_text())
            (run_dir / "metrics.json").write_text(json.dumps({**metrics, "machine": info}))
        return run_dir

    runs = [run_on(f"run{i}", i, recorded) for i in range(2)]
    profile = calibrate(runs, tmp_path / "p.yaml")
    written = yaml.safe_load((tmp_path / "p.yaml").read_text())["machine"]
    # Another machine's runs: its CPU, ISA and threads; no copy bandwidth (it cannot be measured from here).
    assert written == profile["machine"] and list(written)[:5] == list(this_machine.MACHINE_KEYS)
    assert {k: written[k] for k in ("cpu", "arch", "isa", "threads")} == recorded
    assert written["copy_bandwidth_gbs"] is None and "metrics.json" in written["source"]
    # Runs without a record (made before runs recorded one): the calibrating process's machine, measured here.
    old = calibrate([run_on("old", 3, None)], tmp_path / "q.yaml")["machine"]
    info = machine.describe(torch.get_num_threads(), bandwidth=False)
    assert {k: old[k] for k in ("cpu", "arch", "isa", "threads")} == {k: info[k] for k in ("cpu", "arch", "isa",
                                                                                            "threads")}
    assert old["copy_bandwidth_gbs"] > 0 and "calibrating process" in old["source"]
    # Refitting the runs a profile names keeps the machine it records (a shipped profile's, refitted anywhere).
    profile_of_old = yaml.safe_load((tmp_path / "q.yaml").read_text())
    (tmp_path / "q.yaml").write_text(yaml.safe_dump({**profile_of_old, "machine": recorded}))
    assert calibrate([tmp_path / "old"], tmp_path / "q.yaml")["machine"] == recorded
    assert calibrate([tmp_path / "old"], tmp_path / "elsewhere.yaml")["machine"] == old  # a new file: this one's
    # Runs of two machines make no one profile.
    with pytest.raises(ValueError, match="runs were measured on different machines"):
        calibrate([*runs, run_on("other", 4, {**recorded, "threads": 1})], tmp_path / "r.yaml")


def test_a_real_run_records_its_machine_and_calibrate_cli_checks_its_arguments(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    proc = _cli("workload=synthetic", "workload.num_requests=2", "workload.request_rate=100",
                "workload.input_len.mean=16", "workload.output_len.kind=fixed", "workload.output_len.mean=4",
                "monitor.calibrate=false", "progress=false", f"hydra.run.dir={run_dir}", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    info, recorded = machine.describe(bandwidth=False), read_run(run_dir).metrics["machine"]
    assert list(recorded) == ["cpu", "arch", "isa", "threads"] and recorded["threads"] >= 1  # the run's torch threads
    assert {key: recorded[key] for key in ("cpu", "arch", "isa")} == {key: info[key] for key in ("cpu", "arch", "isa")}
    for args, message in [(["--this-machine", str(run_dir)], "--this-machine makes its own runs; give it no RUN_DIRs"),
                          ([str(run_dir)], "give RUN_DIR... and --out PROFILE, or --this-machine"),
                          (["--this-machine", "--full", "--rounds", "2"], "give --full or --rounds, not both")]:
        with pytest.raises(SystemExit) as exited:
            calibrate_main(args)
        assert (exited.value.code, capsys.readouterr().err.strip().splitlines()) == (1, [f"error: {message}"])


def test_cli_simulation_on_another_machines_profile_prints_and_logs_one_line(tmp_path) -> None:
    here = machine.describe(bandwidth=False)
    profile = tmp_path / "other.yaml"
    profile.write_text(yaml.safe_dump(_profile_on({**here, "cpu": "Another CPU", "threads": 1})))
    run_dir = tmp_path / "run"
    proc = _cli("runner=sim", f"runner.profile={profile}", "workload=synthetic", "workload.num_requests=20",
                "progress=false", "monitor.calibrate=false", f"hydra.run.dir={run_dir}", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "step-time profile" in line]
    assert len(lines) == 1 and "[WARNING]" in lines[0] and "was measured on Another CPU" in lines[0], proc.stdout
    assert "calibrate --this-machine --dtype bfloat16" in lines[0] and proc.stderr.strip() == ""
    assert [line for line in (run_dir / "run.log").read_text().splitlines() if "step-time profile" in line] == lines


@pytest.mark.parametrize("model, kv_cache_dtype, quantization, tp", [
    ("llama-3-8b", "auto", None, 1), ("llama-3.1-70b", "auto", None, 4), ("qwen2.5-7b", "int8", None, 1),
    ("llama-2-7b", "auto", "int8", 1), ("llama-3.1-8b", "auto", None, 2)])
def test_decode_stretch_durations_are_the_models_own_step_by_step(model: str, kv_cache_dtype: str,
                                                                    quantization: str | None, tp: int) -> None:
    """``predict_decodes`` (a decode stretch's durations, a chunk at once) gives exactly ``predict``'s figure for
    each step, over contexts whose costs fit 64-bit integers and contexts so long that they would not (Python
    integers then: the cost model's products overflow int64 past about 2**45 tokens)."""
    hardware = Hardware.from_config(yaml.safe_load((ROOT / "conf/hardware/h100_sxm.yaml").read_text()))
    sim = Simulation.build(EngineConfig(model=str(ROOT / "nanovllm/data/models" / model), dtype="bfloat16",
                                        kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                                        tensor_parallel_size=tp, max_num_seqs=128, max_model_len=4096),
                           "analytical", hardware=hardware)
    rng = np.random.default_rng(0)
    for size, first in ((1, 5), (7, 12_345), (128, 1_000_000), (128, 2**32), (128, 2**45)):
        context = first + size * np.arange(int(rng.integers(1, 40)))
        stretch = sim.model.predict_decodes(size, context)
        one_by_one = [sim.model.predict({"num_prefill_tokens": 0, "num_decode_tokens": size, "num_prefill_seqs": 0,
                                         "num_decode_seqs": size, "context_tokens": int(c), "attn_pairs": int(c),
                                         "num_sampled": size}, 0.0) for c in context]
        assert stretch.tolist() == one_by_one, (size, first)


@pytest.mark.slow
def test_run_engine_lets_the_callers_overrides_win_over_its_own(tmp_path):
    """``this_machine.run_engine`` sets ``engine.max_num_seqs=8`` for the calibration workloads; a caller that
    asks for another batch cap (a study calibrating larger batches) gets it in the run's config."""
    run_dir = tmp_path / "run"
    this_machine.run_engine(["runner=sim", "workload.num_requests=2", "engine.max_num_seqs=3"], run_dir, "float32",
                            echo=False)
    assert json.loads((run_dir / "config.json").read_text())["engine"]["max_num_seqs"] == 3
