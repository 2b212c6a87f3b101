"""runner.step_time=profiled: Vidur-format GPU operator profiles (mlp.csv, optionally attention.csv) interpolated by
size and summed over the layers, with attention from the analytical roofline where no attention.csv is given. The
profiles here are small synthetic files in Vidur's column layout, written by the tests (no measured data)."""

from __future__ import annotations

import csv

import pytest

from nanovllm.config import EngineConfig
from nanovllm.harness.sim import Hardware, Simulation
from nanovllm.harness.sim.operator_profile import Curve, split_attention
from nanovllm.harness.sim.step_time import tensor_parallel_seconds
from nanovllm.harness.workload import SyntheticWorkloadConfig, generate_workload

# Per-layer operators and their synthetic cost in ms: base + slope x tokens (linear, so interpolation is exact).
OPS = {"input_layernorm": (0.002, 1e-6), "attn_pre_proj": (0.01, 2e-5), "attn_rope": (0.003, 1e-6),
       "attn_post_proj": (0.006, 1e-5), "post_attention_layernorm": (0.002, 1e-6), "mlp_up_proj": (0.02, 5e-5),
       "mlp_act": (0.004, 3e-6), "mlp_down_proj": (0.01, 2.5e-5), "add": (0.001, 1e-6)}
EMB = (0.005, 1e-6)
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
PREFILL_MS_PER_PAIR, DECODE_MS_PER_KV_TOKEN = 2e-7, 3e-7


def _h100() -> Hardware:
    return Hardware(name="h100", peak_flops={"bfloat16": 989e12}, memory_bandwidth=3.35e12, memory_bytes=80e9,
                    step_overhead=0.002, tp_link_bandwidth=3.6e11, tp_link_latency=1e-5)


def _layer_ms(tokens: float, tp: int = 1) -> float:
    return sum(base + slope * tokens for base, slope in OPS.values()) / tp


def _emb_ms(tokens: float, tp: int = 1) -> float:
    return (EMB[0] + EMB[1] * tokens) / tp


def _shape(cost) -> dict:
    return {"n_head": cost.num_heads, "n_kv_head": cost.num_kv_heads, "n_embd": cost.hidden_size,
            "n_expanded_embd": cost.intermediate_size, "vocab_size": cost.vocab_size, "use_gated_mlp": True}


def write_mlp_csv(path, shape: dict, tps=(1, 2)) -> None:
    """Vidur's mlp.csv layout: the model shape, num_tokens, num_tensor_parallel_workers, time_stats.<op>.median
    (per rank: a TP degree of t divides each operator's time by t here)."""
    columns = [*shape, "num_tokens", "num_tensor_parallel_workers",
               *(f"time_stats.{op}.median" for op in (*OPS, "emb"))]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        for tp in tps:
            for n in TOKENS:
                row = {**shape, "num_tokens": n, "num_tensor_parallel_workers": tp,
                       "time_stats.emb.median": _emb_ms(n, tp)}
                row.update({f"time_stats.{op}.median": (b + s * n) / tp for op, (b, s) in OPS.items()})
                writer.writerow(row)


def write_attention_csv(path, cost) -> None:
    """Vidur's attention.csv layout: prefill rows (chunk after cached tokens) and decode rows (batch x KV)."""
    columns = ["n_embd", "n_q_head", "n_kv_head", "block_size", "num_tensor_parallel_workers", "max_model_len",
               "batch_size", "prefill_chunk_size", "kv_cache_size", "is_prefill", "attention_backend",
               "time_stats.attn_prefill.median", "time_stats.attn_decode.median"]
    shape = {"n_embd": cost.hidden_size, "n_q_head": cost.num_heads, "n_kv_head": cost.num_kv_heads,
             "block_size": 16, "num_tensor_parallel_workers": 1, "max_model_len": 4096,
             "attention_backend": "AttentionBackend.FLASHINFER"}
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        for chunk in (16, 64, 256, 1024):
            for cached in (0, 512, 2048):
                pairs = chunk * cached + chunk * (chunk + 1) / 2
                writer.writerow({**shape, "batch_size": 1, "prefill_chunk_size": chunk, "kv_cache_size": cached,
                                 "is_prefill": True, "time_stats.attn_prefill.median": PREFILL_MS_PER_PAIR * pairs})
        for batch in (1, 8, 64):
            for kv in (128, 1024, 4096):
                writer.writerow({**shape, "batch_size": batch, "prefill_chunk_size": 0, "kv_cache_size": kv,
                                 "is_prefill": False,
                                 "time_stats.attn_decode.median": DECODE_MS_PER_KV_TOKEN * batch * kv})


@pytest.fixture(scope="module")
def analytical():
    return Simulation.build(EngineConfig(dtype="bfloat16", max_num_seqs=16), "analytical", hardware=_h100())


def _profiled(directory, tp: int = 1, **config) -> Simulation:
    return Simulation.build(EngineConfig(dtype="bfloat16", max_num_seqs=16, tensor_parallel_size=tp, **config),
                            "profiled", profile=str(directory), hardware=_h100())


def _step(prefill: int = 0, decodes: int = 0, context: int = 0, pairs: int = 0, sampled: int = 1) -> dict:
    return {"num_prefill_tokens": prefill, "num_prefill_seqs": int(prefill > 0), "num_decode_tokens": decodes,
            "num_decode_seqs": decodes, "context_tokens": context, "attn_pairs": pairs, "num_sampled": sampled}


def test_curve_is_linear_between_points_median_of_repeats_held_below_and_proportional_above():
    curve = Curve.from_points([(4, 2.0), (2, 1.0), (8, 6.0), (8, 3.0), (8, 100.0)])
    assert list(curve.x) == [2, 4, 8] and list(curve.y) == [1.0, 2.0, 6.0]  # 8 measured thrice: the median
    assert curve(3) == pytest.approx(1.5) and curve(6) == pytest.approx(4.0)
    assert curve(1) == 1.0 and curve(0) == 0.0     # below the smallest size: its time; nothing to do: none
    assert curve(16) == pytest.approx(12.0)        # above the largest: proportional to size


def test_split_attention_is_exact_for_one_prefill_chunk_among_decodes():
    # One chunk of 100 tokens after 300 cached, and decodes of contexts 10..50 (each reads its context).
    contexts = [10, 20, 30, 40, 50]
    features = _step(prefill=100, decodes=5, context=400 + sum(contexts),
                     pairs=100 * 300 + 100 * 101 // 2 + sum(contexts))
    assert split_attention(features) == (100 * 300 + 100 * 101 // 2, sum(contexts))
    assert split_attention(_step(decodes=3, context=90, pairs=90)) == (0, 90)
    assert split_attention(_step(prefill=64, context=64, pairs=64 * 65 // 2)) == (64 * 65 // 2, 0)


def test_profiled_sums_the_measured_operators_over_the_layers(tmp_path, analytical):
    cost = analytical.cost
    write_mlp_csv(tmp_path / "mlp.csv", _shape(cost))
    sim = _profiled(tmp_path)
    model, layers = sim.model, cost.num_layers
    assert model.describe() == f"profiled:{tmp_path.name}/tp1/attention=analytical:h100"
    decode = _step(decodes=24, context=24 * 500, pairs=24 * 500, sampled=24)
    prefill = _step(prefill=3000, context=3000, pairs=3000 * 3001 // 2)  # beyond the profile's 1,024 tokens
    for features, tokens in ((decode, 24), (prefill, 3000)):
        linear_s = (layers * _layer_ms(tokens) + _emb_ms(tokens)) / 1000
        if tokens > TOKENS[-1]:  # extrapolated in proportion to the largest measured point
            linear_s = (layers * _layer_ms(TOKENS[-1]) + _emb_ms(TOKENS[-1])) / 1000 * tokens / TOKENS[-1]
        rest = model.predict(features, 0.0) - 0.002 - linear_s
        # What is left is attention and the LM head, priced by the roofline: never less than reading the KV cache.
        kv_read_s = features["context_tokens"] * cost.kv_bytes_per_token / (0.8 * 3.35e12)
        assert rest == pytest.approx(model.attention_seconds(features) + model.lm_head_seconds(features))
        assert model.attention_seconds(features) >= kv_read_s
    # Attention grows with the context the decodes read, the linears do not.
    longer = {**decode, "context_tokens": 24 * 4000, "attn_pairs": 24 * 4000}
    extra = 24 * 3500 * cost.kv_bytes_per_token / (0.8 * 3.35e12)
    assert model.predict(longer, 0.0) - model.predict(decode, 0.0) == pytest.approx(extra)


def test_attention_csv_prices_prefill_pairs_and_decode_kv_per_layer(tmp_path, analytical):
    cost = analytical.cost
    write_mlp_csv(tmp_path / "mlp.csv", _shape(cost))
    write_attention_csv(tmp_path / "attention.csv", cost)
    model = _profiled(tmp_path).model
    assert model.describe().endswith("attention=profiled:h100")
    contexts = [100, 900, 2000]
    mixed = _step(prefill=200, decodes=3, context=1000 + 200 + sum(contexts),
                  pairs=200 * 1000 + 200 * 201 // 2 + sum(contexts), sampled=4)
    expected_ms = PREFILL_MS_PER_PAIR * (200 * 1000 + 200 * 201 / 2) + DECODE_MS_PER_KV_TOKEN * sum(contexts)
    assert model.attention_seconds(mixed) == pytest.approx(cost.num_layers * expected_ms / 1000)


def test_the_tensor_parallel_degree_picks_its_rows(tmp_path, analytical):
    cost = analytical.cost
    write_mlp_csv(tmp_path / "mlp.csv", _shape(cost))
    one, two = _profiled(tmp_path).model, _profiled(tmp_path, tp=2).model
    decode = _step(decodes=8, context=8 * 300, pairs=8 * 300, sampled=8)
    # Every term is split over two ranks: the profile's rows for TP 2 (half here) and the analytical parts; the
    # ranks' collectives come on top, priced as the analytical model prices them.
    collectives = tensor_parallel_seconds(cost, _h100(), 2, decode)
    assert collectives > 0
    assert two.predict(decode, 0.0) - 0.002 - collectives == pytest.approx((one.predict(decode, 0.0) - 0.002) / 2)
    with pytest.raises(ValueError, match=r"mlp\.csv: no row is of this run's model and tensor-parallel degree "
                                         r"\(.*num_tensor_parallel_workers=4\); the file has .*"
                                         r"num_tensor_parallel_workers=1"):
        _profiled(tmp_path, tp=4)


def test_a_profile_of_another_model_or_a_bad_cell_is_an_error_naming_it(tmp_path, analytical):
    cost = analytical.cost
    other = tmp_path / "other"
    other.mkdir()
    write_mlp_csv(other / "mlp.csv", {**_shape(cost), "n_embd": 4096, "n_expanded_embd": 11008})
    with pytest.raises(ValueError, match=rf"n_embd={cost.hidden_size}.*the file has .*n_embd=4096"):
        _profiled(other)
    bad = tmp_path / "bad"
    bad.mkdir()
    write_mlp_csv(bad / "mlp.csv", _shape(cost))
    lines = (bad / "mlp.csv").read_text().splitlines()
    lines[3] = lines[3].rsplit(",", 1)[0] + ",fast"
    (bad / "mlp.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"bad/mlp\.csv:4: 'time_stats\.emb\.median' must be a number >= 0, "
                                         r"got 'fast'"):
        _profiled(bad)
    with pytest.raises(ValueError, match=r"runner\.profile: .*empty.* is not a directory"):
        _profiled(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"hardware is not set; the profiled step-time model needs"):
        Simulation.build(EngineConfig(dtype="bfloat16"), "profiled", profile=str(bad))


def test_a_simulated_run_takes_each_steps_time_from_the_profile(tmp_path, tokenizer, analytical):
    write_mlp_csv(tmp_path / "mlp.csv", _shape(analytical.cost))
    sim = _profiled(tmp_path)
    workload = generate_workload(SyntheticWorkloadConfig(num_requests=6, request_rate=50.0, seed=3), tokenizer)
    result = sim.serve(workload)
    assert len(result.requests) == 6 and all(r["num_output_tokens"] == 128 for r in result.requests)
    working = [s for s in result.steps if s["num_prefill_tokens"] + s["num_decode_seqs"] > 0]
    assert working and all(s["duration"] == pytest.approx(sim.model.predict(s, 0.0)) for s in working)
