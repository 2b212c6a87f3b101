"""Workload generation: determinism, arrival statistics, length distributions, prefixes, classes, traces."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from omegaconf import OmegaConf

from nanovllm.harness.workload import (
    ChatWorkloadConfig,
    LengthDist,
    SyntheticWorkloadConfig,
    TraceWorkloadConfig,
    generate_workload,
    load_chat_prompts,
    sample_arrival_times,
    sample_lengths,
    validate_workload_config,
)


def _gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(times)


# --------------------------------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------------------------------

def test_same_seed_same_workload(tokenizer):
    cfg = SyntheticWorkloadConfig(num_requests=50, request_rate=5.0, burstiness=0.5,
                                  input_len=LengthDist(kind="lognormal", mean=40, max=200),
                                  output_len=LengthDist(kind="uniform", mean=20, range_ratio=0.5),
                                  num_prefix_groups=3, prefix_len=8, priority_classes=[0, 1],
                                  priority_weights=[0.5, 0.5], num_clients=3, seed=7)
    assert generate_workload(cfg, tokenizer) == generate_workload(cfg, tokenizer)
    other = generate_workload(replace(cfg, seed=8), tokenizer)
    assert [r.prompt for r in other] != [r.prompt for r in generate_workload(cfg, tokenizer)]


def test_global_rng_untouched(tokenizer):
    np.random.seed(123)
    expected = np.random.random()
    np.random.seed(123)
    generate_workload(SyntheticWorkloadConfig(num_requests=10, request_rate=3.0), tokenizer)
    assert np.random.random() == expected


def test_changing_priority_weights_keeps_arrivals_and_prompts(tokenizer):
    base = SyntheticWorkloadConfig(num_requests=30, request_rate=4.0, priority_classes=[0, 1],
                                   priority_weights=[0.5, 0.5], input_len=LengthDist(mean=16))
    a = generate_workload(base, tokenizer)
    b = generate_workload(replace(base, priority_weights=[0.9, 0.1]), tokenizer)
    assert [r.arrival_time for r in a] == [r.arrival_time for r in b]
    assert [r.prompt for r in a] == [r.prompt for r in b]


# --------------------------------------------------------------------------------------------------------------
# Arrivals
# --------------------------------------------------------------------------------------------------------------

def test_infinite_rate_means_all_at_zero(tokenizer):
    reqs = generate_workload(SyntheticWorkloadConfig(num_requests=8, input_len=LengthDist(mean=4)), tokenizer)
    assert [r.arrival_time for r in reqs] == [0.0] * 8


def test_poisson_mean_gap_and_cv():
    times = sample_arrival_times(2000, 10.0, 1.0, np.random.default_rng(0))
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    gaps = _gaps(times)
    # Tolerances ~4 standard errors for 2000 gaps (checked over 200 seeds), so they never flake.
    assert gaps.mean() == pytest.approx(0.1, rel=0.09)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.12)  # exponential gaps: CV = 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_changes_cv_not_rate(burstiness):
    gaps = _gaps(sample_arrival_times(2000, 10.0, burstiness, np.random.default_rng(1)))
    assert gaps.mean() == pytest.approx(0.1, rel=0.2)
    # Gamma(shape=k) gaps have CV = 1/sqrt(k): burstier (k<1) -> above 1, steadier (k>1) -> below.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.2)


def test_burstier_has_higher_cv_than_poisson():
    cv = {}
    for b in (0.3, 1.0):
        gaps = _gaps(sample_arrival_times(2000, 20.0, b, np.random.default_rng(2)))
        cv[b] = gaps.std() / gaps.mean()
    assert cv[0.3] > 1.3 * cv[1.0]


def test_workload_arrivals_sorted_and_rate(tokenizer):
    cfg = SyntheticWorkloadConfig(num_requests=400, request_rate=50.0, input_len=LengthDist(mean=2),
                                  output_len=LengthDist(mean=2))
    times = np.array([r.arrival_time for r in generate_workload(cfg, tokenizer)])
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    assert times[-1] / 399 == pytest.approx(1 / 50.0, rel=0.15)


# --------------------------------------------------------------------------------------------------------------
# Lengths
# --------------------------------------------------------------------------------------------------------------

def _lengths(n: int = 50_000, **kw) -> np.ndarray:
    return sample_lengths(LengthDist(**kw), n, np.random.default_rng(3))


def test_fixed_length():
    assert set(_lengths(100, kind="fixed", mean=37).tolist()) == {37}


def test_uniform_length_bounds_and_mean():
    x = _lengths(kind="uniform", mean=100, range_ratio=0.3)
    assert x.min() == 70 and x.max() == 130  # both ends inclusive, like vllm bench's random dataset
    assert x.mean() == pytest.approx(100, rel=0.01)


def test_uniform_range_clipped_to_min_max():
    x = _lengths(kind="uniform", mean=100, range_ratio=0.9, min=50, max=120)
    assert x.min() >= 50 and x.max() <= 120


def test_lognormal_mean_and_bounds():
    x = _lengths(kind="lognormal", mean=200, sigma=0.6)
    assert x.mean() == pytest.approx(200, rel=0.03)
    assert np.median(x) < x.mean()  # right-skewed
    y = _lengths(kind="lognormal", mean=200, sigma=1.5, min=20, max=400)
    assert y.min() >= 20 and y.max() <= 400


@pytest.mark.parametrize("alpha,mean", [(1.5, 128), (2.5, 300), (1.1, 1500)])
def test_zipf_mean_after_clipping(alpha, mean):
    x = _lengths(200_000, kind="zipf", alpha=alpha, mean=mean, max=4096)
    assert x.min() >= 1 and x.max() <= 4096
    assert x.mean() == pytest.approx(mean, rel=0.05)
    assert np.median(x) < 0.8 * mean  # heavy tail: most requests are short


def test_zipf_unreachable_mean_is_a_config_error():
    with pytest.raises(ValueError, match=r"input_len\.alpha"):
        SyntheticWorkloadConfig(input_len=LengthDist(kind="zipf", alpha=1.05, mean=10, max=4096))


def test_synthetic_prompt_and_output_lengths(tokenizer):
    cfg = SyntheticWorkloadConfig(num_requests=300, input_len=LengthDist(kind="uniform", mean=30, range_ratio=0.5),
                                  output_len=LengthDist(kind="lognormal", mean=50, max=90))
    reqs = generate_workload(cfg, tokenizer)
    lens = np.array([len(r.prompt) for r in reqs])
    assert lens.min() >= 15 and lens.max() <= 45 and lens.mean() == pytest.approx(30, rel=0.08)
    outs = np.array([r.max_tokens for r in reqs])
    assert outs.min() >= 1 and outs.max() <= 90
    assert all(r.ignore_eos for r in reqs)
    assert len({r.request_id for r in reqs}) == 300


def test_random_prompts_avoid_special_tokens(tokenizer):
    cfg = SyntheticWorkloadConfig(num_requests=200, input_len=LengthDist(mean=64))
    ids = np.concatenate([r.prompt for r in generate_workload(cfg, tokenizer)])
    assert not set(ids.tolist()) & set(tokenizer.all_special_ids)
    assert ids.min() >= 0 and ids.max() < tokenizer.vocab_size


def test_text_prompts_have_exact_length_and_read_as_text(tokenizer):
    cfg = SyntheticWorkloadConfig(num_requests=6, prompt_kind="text",
                                  input_len=LengthDist(kind="uniform", mean=100, range_ratio=0.5))
    words = {w for conv in load_chat_prompts() for m in conv for w in m["content"].split()}
    for r in generate_workload(cfg, tokenizer):
        assert 50 <= len(r.prompt) <= 150
        inner = tokenizer.decode(r.prompt).split()[1:-1]  # the first and last word may be cut mid-token
        assert sum(w in words for w in inner) >= 0.9 * len(inner)


# --------------------------------------------------------------------------------------------------------------
# Prefix groups, priorities, clients
# --------------------------------------------------------------------------------------------------------------

def test_prefix_groups_share_prefixes(tokenizer):
    cfg = SyntheticWorkloadConfig(num_requests=60, num_prefix_groups=4, prefix_len=32,
                                  input_len=LengthDist(kind="uniform", mean=10, range_ratio=0.5))
    reqs = generate_workload(cfg, tokenizer)
    prefixes = {tuple(r.prompt[:32]) for r in reqs}
    assert len(prefixes) == 4  # every group used, and no request has a prefix of its own
    for r in reqs:
        assert 32 + 5 <= len(r.prompt) <= 32 + 15  # prefix + its own suffix of input_len tokens
    suffixes = [tuple(r.prompt[32:]) for r in reqs]
    assert len(set(suffixes)) == len(suffixes)  # suffixes are not shared


@pytest.mark.parametrize("kw", [dict(num_prefix_groups=2, prefix_len=0), dict(num_prefix_groups=0, prefix_len=8)])
def test_prefix_settings_must_agree(kw):
    with pytest.raises(ValueError, match="num_prefix_groups|prefix_len"):
        SyntheticWorkloadConfig(**kw)


def test_priority_proportions(tokenizer):
    cfg = SyntheticWorkloadConfig(num_requests=3000, priority_classes=[0, 1, 2], priority_weights=[7, 2, 1],
                                  input_len=LengthDist(mean=1), output_len=LengthDist(mean=1))
    pri = np.array([r.priority for r in generate_workload(cfg, tokenizer)])
    for cls, share in ((0, 0.7), (1, 0.2), (2, 0.1)):
        assert np.mean(pri == cls) == pytest.approx(share, abs=0.03)


def test_client_shares_keep_arrival_process(tokenizer):
    base = SyntheticWorkloadConfig(num_requests=2000, request_rate=10.0, num_clients=2,
                                   input_len=LengthDist(mean=1), output_len=LengthDist(mean=1))
    even = generate_workload(base, tokenizer)
    skewed = generate_workload(replace(base, client_rate_shares=[3.0, 1.0]), tokenizer)
    assert [r.arrival_time for r in even] == [r.arrival_time for r in skewed]
    assert np.mean([r.client_id == "client0" for r in even]) == pytest.approx(0.5, abs=0.04)
    assert np.mean([r.client_id == "client0" for r in skewed]) == pytest.approx(0.75, abs=0.03)
    assert {r.client_id for r in skewed} == {"client0", "client1"}


# --------------------------------------------------------------------------------------------------------------
# Chat
# --------------------------------------------------------------------------------------------------------------

def test_chat_dataset_shape():
    convs = load_chat_prompts()
    assert 60 <= len(convs) <= 80
    assert all(conv[-1]["role"] == "user" and conv[-1]["content"].strip() for conv in convs)
    assert sum(conv[0]["role"] == "system" for conv in convs) >= 3
    assert sum(len(conv[-1]["content"].split()) >= 150 for conv in convs) >= 3


def test_chat_workload_templates_every_prompt(tokenizer):
    n = len(load_chat_prompts())
    reqs = generate_workload(ChatWorkloadConfig(num_requests=n, max_tokens=64, request_rate=4.0), tokenizer)
    assert len({json.dumps(r.messages) for r in reqs}) == n  # a shuffled pass: no repeats before all are used
    for r in reqs[:5]:
        expected = tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert r.prompt == list(expected)
    assert all(r.max_tokens == 64 and not r.ignore_eos for r in reqs)


def test_chat_from_omegaconf(tokenizer):
    cfg = OmegaConf.structured(ChatWorkloadConfig(num_requests=3, priority_classes=[0, 1],
                                                  priority_weights=[1, 1]))
    reqs = generate_workload(cfg, tokenizer)
    assert len(reqs) == 3 and all(isinstance(r.prompt, list) for r in reqs)


# --------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,field", [
    (dict(request_rate=0.0), "request_rate"),
    (dict(request_rate=-2.0), "request_rate"),
    (dict(burstiness=0.0), "burstiness"),
    (dict(num_requests=0), "num_requests"),
    (dict(num_clients=0), "num_clients"),
    (dict(input_len=LengthDist(kind="normal")), "input_len.kind"),
    (dict(input_len=LengthDist(min=10, max=5, mean=7)), "input_len.max"),
    (dict(output_len=LengthDist(mean=0.5)), "output_len.mean"),
    (dict(output_len=LengthDist(kind="uniform", range_ratio=1.0)), "output_len.range_ratio"),
    (dict(output_len=LengthDist(kind="zipf", alpha=1.0)), "output_len.alpha"),
    (dict(priority_weights=[1.0, 1.0]), "priority_weights"),
    (dict(priority_classes=[0, 1], priority_weights=[1.0, -1.0]), "priority_weights"),
    (dict(priority_classes=[0, 1], priority_weights=[0.0, 0.0]), "priority_weights"),
    (dict(num_clients=2, client_rate_shares=[1.0]), "client_rate_shares"),
    (dict(prompt_kind="words"), "prompt_kind"),
])
def test_invalid_synthetic_config(kw, field):
    with pytest.raises(ValueError, match=rf"workload\.{field}=") as e:
        SyntheticWorkloadConfig(**kw)
    assert "must" in str(e.value)  # says what is allowed


def test_invalid_dictconfig_after_override():
    cfg = OmegaConf.structured(SyntheticWorkloadConfig)
    cfg.request_rate = -1.0  # an override: the dataclass's own check never sees it
    with pytest.raises(ValueError, match=r"workload\.request_rate=-1\.0"):
        validate_workload_config(cfg)
    cfg.request_rate = 2.0
    cfg.input_len.min = 0
    with pytest.raises(ValueError, match=r"workload\.input_len\.min=0"):
        validate_workload_config(cfg)


def test_unknown_workload_name(tokenizer):
    cfg = OmegaConf.structured(SyntheticWorkloadConfig)
    cfg.name = "bursty"
    with pytest.raises(ValueError, match="workload.name='bursty'.*synthetic, chat, trace"):
        generate_workload(cfg, tokenizer)


def test_trace_path_required(tokenizer, tmp_path):
    TraceWorkloadConfig()  # buildable before the path is known (Hydra default)
    with pytest.raises(ValueError, match=r"workload\.path=''"):
        generate_workload(TraceWorkloadConfig(), tokenizer)
    with pytest.raises(ValueError, match="no such file"):
        generate_workload(TraceWorkloadConfig(path=str(tmp_path / "missing.jsonl")), tokenizer)
    (tmp_path / "t.txt").write_text("x")  # (.csv is a CSV trace: tests/harness/test_workload_csv_traces.py)
    with pytest.raises(ValueError, match=r"\.jsonl"):
        generate_workload(TraceWorkloadConfig(path=str(tmp_path / "t.txt")), tokenizer)


# --------------------------------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------------------------------

def _write_lines(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_trace(tokenizer, tmp_path):
    path = _write_lines(tmp_path / "trace.jsonl", [
        {"arrival_time": 1.5, "prompt": "Hello there", "output_len": 7, "priority": 2, "client_id": "alice"},
        "",
        {"arrival_time": 0.5, "prompt_len": 12},
        {"arrival_time": 3.0, "prompt_len": 5, "output_len": 3, "request_id": "x9"},
    ])
    reqs = generate_workload(TraceWorkloadConfig(path=path, time_scale=2.0, default_output_len=11), tokenizer)
    assert [r.arrival_time for r in reqs] == [1.0, 3.0, 6.0]  # sorted, times scaled
    first, second, third = reqs
    assert isinstance(first.prompt, list) and len(first.prompt) == 12 and first.max_tokens == 11
    assert second.prompt == "Hello there" and second.max_tokens == 7
    assert (second.priority, second.client_id) == (2, "alice")
    assert third.request_id == "x9" and len(third.prompt) == 5
    again = generate_workload(TraceWorkloadConfig(path=path, time_scale=2.0, default_output_len=11), tokenizer)
    assert again == reqs  # prompt_len tokens are seeded


def test_jsonl_max_requests(tokenizer, tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", [{"arrival_time": i, "prompt_len": 3} for i in range(10)])
    assert len(generate_workload(TraceWorkloadConfig(path=path, max_requests=4), tokenizer)) == 4


@pytest.mark.parametrize("bad,message", [
    ('{"arrival_time": 1.0, "prompt": "x"', "invalid JSON"),
    ({"prompt": "x"}, "'arrival_time'"),
    ({"arrival_time": -1, "prompt": "x"}, "'arrival_time'"),
    ({"arrival_time": 1.0}, "needs 'prompt'"),
    ({"arrival_time": 1.0, "prompt_len": 0}, "'prompt_len' must be an integer >= 1"),
    ({"arrival_time": 1.0, "prompt": "x", "output_len": "ten"}, "'output_len'"),
    ([1, 2], "expected a JSON object"),
    ({"arrival_time": "soon", "prompt": "x"}, "'arrival_time' must be a number"),
    ('{"arrival_time": NaN, "prompt": "x"}', "'arrival_time' must be a number"),
    ({"arrival_time": 1.0, "prompt": ""}, "'prompt' must be a non-empty string"),
    ({"arrival_time": 1.0, "prompt": "x", "priority": 1.5}, "'priority' must be an integer"),
    ({"arrival_time": 1.0, "prompt": "x", "client_id": 7}, "'client_id' must be a string"),
    ({"arrival_time": 1.0, "prompt": "x", "request_id": {"a": 1}}, "'request_id' must be a string or an integer"),
    ({"arrival_time": 1.0, "prompt": "x", "output_length": 3}, "unknown field(s) 'output_length'"),
])
def test_jsonl_malformed_line_names_file_and_line(tokenizer, tmp_path, bad, message):
    path = _write_lines(tmp_path / "bad.jsonl", [
        {"arrival_time": 0.0, "prompt": "fine"}, "", bad, {"arrival_time": 2.0, "prompt": "fine"}])
    with pytest.raises(ValueError) as e:
        generate_workload(TraceWorkloadConfig(path=path), tokenizer)
    assert "bad.jsonl:3: " in str(e.value) and message in str(e.value)


def test_jsonl_repeated_request_id_names_both_lines(tokenizer, tmp_path):
    path = _write_lines(tmp_path / "dup.jsonl", [
        {"arrival_time": 0.0, "prompt": "a", "request_id": "r"}, {"arrival_time": 0.5, "prompt": "b", "request_id": 7},
        {"arrival_time": 1.0, "prompt": "c", "request_id": "r"}])
    with pytest.raises(ValueError, match=r"dup\.jsonl:3: 'request_id' 'r' repeats line 1"):
        generate_workload(TraceWorkloadConfig(path=path), tokenizer)


def test_jsonl_out_of_order_arrivals_are_served_in_time_order(tokenizer, tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", [{"arrival_time": 2.0, "prompt": "late", "request_id": "late"},
                                               {"arrival_time": 0.5, "prompt": "early", "request_id": "early"}])
    reqs = generate_workload(TraceWorkloadConfig(path=path), tokenizer)
    assert [(r.request_id, r.arrival_time) for r in reqs] == [("early", 0.5), ("late", 2.0)]


def test_sharegpt(tokenizer, tmp_path):
    reply = "Sure. Here is a short answer with a handful of tokens."
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "Tell me something."},
                                       {"from": "gpt", "value": reply},
                                       {"from": "human", "value": "More?"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "No answer here."}]},  # skipped
        {"id": "c", "conversations": [{"from": "system", "value": "be nice"},
                                       {"from": "human", "value": "Second prompt"},
                                       {"from": "gpt", "value": "Ok"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    cfg = TraceWorkloadConfig(path=str(path), request_rate=2.0, seed=3)
    reqs = generate_workload(cfg, tokenizer)
    assert [r.prompt for r in reqs] == ["Tell me something.", "Second prompt"]
    assert reqs[0].max_tokens == len(tokenizer.encode(reply, add_special_tokens=False))
    assert reqs[0].arrival_time == 0.0 and reqs[1].arrival_time > 0.0
    assert generate_workload(cfg, tokenizer) == reqs


def test_empty_trace_is_an_error(tokenizer, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no usable requests"):
        generate_workload(TraceWorkloadConfig(path=str(tmp_path / "empty.jsonl")), tokenizer)
    (tmp_path / "sg.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}]))
    with pytest.raises(ValueError, match="no usable requests"):
        generate_workload(TraceWorkloadConfig(path=str(tmp_path / "sg.json"), request_rate=1.0), tokenizer)


def test_sharegpt_malformed(tokenizer, tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": []}, {"no": "conversations"}]))
    with pytest.raises(ValueError, match=r"sg\.json: entry 1"):
        generate_workload(TraceWorkloadConfig(path=str(path)), tokenizer)
    path.write_text('[{"conversations": [}')
    with pytest.raises(ValueError, match=r"sg\.json:1: invalid JSON"):
        generate_workload(TraceWorkloadConfig(path=str(path)), tokenizer)
