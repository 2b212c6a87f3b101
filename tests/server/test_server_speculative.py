"""The server with speculative decoding on (``ngram``, float32, torch attention), over real HTTP: a greedy
completion, streamed or not, is the same text and tokens as decoding without speculation; a step that accepts
proposals sends several tokens in one delta; a stop string inside an accepted run cuts the output there; and
``/metrics`` and the run's ``metrics.json`` count the proposals under vLLM's names."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.engine.engine import LLMEngine
from nanovllm.serving.loggers import JsonlLogger
from nanovllm.server.app import ServerState
from nanovllm.server.config import ServerConfig
from nanovllm.server.http import start_in_thread
from nanovllm.server.prometheus import ServerMetrics
from test_server import MODEL, Served, post_stream, stop_served

LIST = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango"
PROMPT = f"Repeat this list exactly: {LIST}. Again: {LIST}. Again:"
MAX_TOKENS = 40
OPTIONS = dict(dtype="float32", num_kv_blocks=1024, max_model_len=1024, warmup=False)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy output without speculation (``llm`` first: the session's weights are loaded once and shared)."""
    plain = LLM(**OPTIONS, attention="torch")
    (output,) = plain.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return output


@pytest.fixture(scope="module")
def spec_served(reference, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("spec_run")
    config = EngineConfig(**OPTIONS, speculative=dict(method="ngram", num_speculative_tokens=3))
    engine = LLMEngine(config, allocator="prefix", attention="torch")
    files = JsonlLogger()
    files.start(run_dir, {"server": "test"})
    state = ServerState(engine, ServerConfig(port=0), MODEL, ServerMetrics(MODEL, "fcfs", "prefix"),
                        loggers=[files])
    served = Served(start_in_thread(state), state, run_dir)
    yield served
    if not getattr(served, "stopped", False):
        stop_served(served)


def test_greedy_completion_with_speculation_is_the_text_and_tokens_without_it(spec_served, reference, tokenizer):
    with httpx.Client(base_url=spec_served.url, timeout=120) as client:
        body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                    "logprobs": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == reference.text and choice["finish_reason"] == reference.finish_reason
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in reference.token_ids]
    assert body["usage"]["completion_tokens"] == len(reference.token_ids)


def test_a_stream_gets_several_tokens_in_one_delta_and_the_same_text(spec_served, reference):
    _, events = post_stream(spec_served.url, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [e for e in events if e["choices"]]
    assert "".join(e["choices"][0]["text"] for e in chunks) == reference.text
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    steps = [b - a for a, b in zip([0, *counts], counts)]
    assert counts[-1] == len(reference.token_ids) and all(n >= 0 for n in steps)
    assert max(steps) >= 2   # accepted proposals arrive together with the token that verified them
    assert chunks[-1]["choices"][0]["finish_reason"] == reference.finish_reason


def test_a_stop_string_inside_an_accepted_run_cuts_the_output_there(spec_served, reference, tokenizer):
    with httpx.Client(base_url=spec_served.url, timeout=120) as client:
        client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
                    headers={"x-request-id": "spec-runs"})
    (record,) = [r for r in spec_served.records if r["request_id"] == "spec-runs"]
    times, tokens = record["token_times"], reference.token_ids
    # Tokens of one verification share its time: pick one with a token of its run before and after it, whose
    # text first appears in the output right there, as the stop string.
    stop, expected = None, None
    for i in range(1, len(tokens) - 1):
        if not times[i - 1] == times[i] == times[i + 1]:
            continue
        before = tokenizer.decode(tokens[:i])
        piece = tokenizer.decode(tokens[:i + 1])[len(before):]
        if len(piece.strip()) >= 2 and reference.text.find(piece) == len(before):
            stop, expected = piece, reference.text[:len(before)]
            break
    assert stop is not None, "no accepted run to stop inside"
    with httpx.Client(base_url=spec_served.url, timeout=120) as client:
        body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                    "stop": [stop]}, headers={"x-request-id": "spec-stop"}).json()
    assert body["choices"][0]["text"] == expected and body["choices"][0]["finish_reason"] == "stop"
    _, events = post_stream(spec_served.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                                 "temperature": 0, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    (stopped,) = [r for r in spec_served.records if r["request_id"] == "spec-stop"]
    # Counted up to the token that completed the stop string; those accepted after it are not output.
    assert stopped["finish_reason"] == "stop" and stopped["num_output_tokens"] == i + 1
    assert body["usage"]["completion_tokens"] == i + 1


def _metric(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def test_metrics_and_metrics_json_count_drafts_and_acceptance_under_vllm_names(spec_served):
    with httpx.Client(base_url=spec_served.url, timeout=120) as client:
        before = _metric(client.get("/metrics").text, "vllm:generation_tokens_total")
        body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0}).json()
        text = client.get("/metrics").text
    # Every emitted token counts, the accepted proposals too (not one per sequence and step).
    assert _metric(text, "vllm:generation_tokens_total") - before == body["usage"]["completion_tokens"] == 16
    drafts = _metric(text, "vllm:spec_decode_num_drafts_total")
    draft_tokens = _metric(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < drafts <= draft_tokens and 0 < accepted <= draft_tokens
    per_pos = {line.split('position="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")}
    assert set(per_pos) == {"0", "1", "2"} and sum(per_pos.values()) == accepted
    assert per_pos["0"] >= per_pos["1"] >= per_pos["2"]   # a proposal is accepted only after those before it
    stop_served(spec_served)   # writes metrics.json
    spec_served.stopped = True
    summary = json.loads((Path(spec_served.run_dir) / "metrics.json").read_text())
    assert (summary["spec_decode_num_drafts"], summary["spec_decode_num_draft_tokens"],
            summary["spec_decode_num_accepted_tokens"]) == (drafts, draft_tokens, accepted)
    assert summary["spec_decode_acceptance_rate"] == pytest.approx(accepted / draft_tokens)
    assert summary["spec_decode_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)
    assert summary["spec_decode_num_accepted_tokens_per_pos"] == [per_pos[p] for p in ("0", "1", "2")]
