"""The OpenAI-compatible server (``nanovllm/server``), in this process: uvicorn in a thread on a free loopback
port, over an engine that shares the session's loaded weights, driven by the openai SDK (completions and chat,
streaming and not) and by raw HTTP (httpx) for the SSE framing and the error cases. Greedy output over HTTP
equals ``LLM.generate`` token for token; every malformed request gets 400 (401, 404, 503) with OpenAI's error
object naming the field while the requests in flight go on; a client that disconnects has its request aborted
and its blocks freed; 200 concurrent streams all end complete and match the server's records; ``runner=http``
against this server writes records with the keys of an in-process run.

The command line (``python -m nanovllm.serve``: Hydra, API key, signals) is in ``test_server_process.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helpers import wait_for
from nanovllm import Policy, SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.engine.engine import LLMEngine
from nanovllm.server.app import ServerState
from nanovllm.server.config import ServerConfig
from nanovllm.server.detokenizer import IncrementalDetokenizer
from nanovllm.server.http import RunningServer, start_in_thread
from nanovllm.server.prometheus import ServerMetrics
from nanovllm.serving.loggers import JsonlLogger
from nanovllm.serving.metrics import summarize
from nanovllm.serving.records import RequestRecord, read_jsonl

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-test"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]


@dataclass
class Served:
    """A server running in this process, its state and its run directory."""

    running: RunningServer
    state: ServerState
    run_dir: Path

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def records(self) -> list[RequestRecord]:
        return list(self.state.engine_loop.records)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)


def serve_in_thread(run_dir: Path, config: ServerConfig | None = None, allocator: str = "prefix",
                    **engine_options: Any) -> Served:
    """An engine over the session's weights (float32, the exact path) behind a server on a free port; its run
    files go to ``run_dir`` through the jsonl logger, as ``python -m nanovllm.serve`` writes them."""
    options = dict(num_kv_blocks=1024, max_model_len=1024, warmup=False)
    engine = LLMEngine(EngineConfig(**{**options, **engine_options}), allocator=allocator)
    files = JsonlLogger()
    files.start(run_dir, {"server": "test"})
    state = ServerState(engine, config or ServerConfig(port=0), MODEL, ServerMetrics(MODEL, "fcfs", allocator),
                        loggers=[files])
    return Served(start_in_thread(state), state, run_dir)


def stop_served(served: Served) -> None:
    served.running.stop()
    served.state.engine_loop.write_summary()
    for run_logger in served.state.loggers:
        run_logger.finish()


@pytest.fixture(scope="module")
def served(llm, tmp_path_factory):
    """One server for the module (``llm`` first: its weights are loaded once and shared)."""
    server = serve_in_thread(tmp_path_factory.mktemp("server_run"))
    yield server
    stop_served(server)


def sse_events(raw: str) -> list[Any]:
    """The events of an SSE body, checking its framing: every event is ``data: <json>`` followed by a blank
    line, and the last is ``data: [DONE]``."""
    assert raw.endswith("\n\n"), "an event is not terminated by a blank line"
    blocks = raw[:-2].split("\n\n")
    assert all(block.startswith("data: ") and "\n" not in block for block in blocks), blocks
    assert blocks[-1] == "data: [DONE]" and "data: [DONE]" not in blocks[:-1]
    return [json.loads(block[len("data: "):]) for block in blocks[:-1]]


def post_stream(url: str, path: str, body: dict, **kwargs: Any) -> tuple[httpx.Response, list[Any]]:
    with httpx.Client(base_url=url, timeout=120) as client:
        response = client.post(path, json={**body, "stream": True}, **kwargs)
    return response, sse_events(response.text) if response.status_code == 200 else []


def no_blocks_in_use(served: Served) -> bool:
    engine = served.state.engine
    return not engine.has_unfinished() and engine.allocator.num_used_blocks() == 0


# -- what comes back equals the engine's own output ----------------------------------------------------------------

def test_completions_over_the_openai_sdk_equal_llm_generate_token_for_token(served, llm, tokenizer):
    client = served.openai()
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, reference in zip(PROMPTS, expected):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=0)
        choice = response.choices[0]
        assert choice.text == reference.text and choice.finish_reason == reference.finish_reason
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in reference.token_ids]
        assert response.usage.completion_tokens == len(reference.token_ids)
        assert response.usage.prompt_tokens == len(reference.prompt_token_ids)
        stream = client.completions.create(model=MODEL, prompt=reference.prompt_token_ids, max_tokens=16,
                                           temperature=0, stream=True)
        pieces = [chunk.choices[0].text for chunk in stream]
        assert "".join(pieces) == reference.text


def test_chat_over_the_openai_sdk_equals_llm_chat(served, llm):
    client = served.openai()
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]
    (reference,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    response = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                              temperature=0)
    assert response.choices[0].message.content == reference.text
    assert response.choices[0].message.role == "assistant" and response.object == "chat.completion"
    assert response.usage.completion_tokens == len(reference.token_ids)
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    stream = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference.token_ids)


def test_multi_byte_characters_are_never_split_across_deltas(tokenizer):
    # Emoji and CJK take several byte-level tokens each: a delta never carries half a character, and the deltas
    # add up to the tokenizer's own decoding of the whole output.
    text = "I love the sea: 海が大好きです 🌊🐚 — naïve café"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # some characters really are split over tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([token]).text for token in ids] + [detokenizer.finish()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in delta for delta in deltas)
    # A stop string split over tokens is never half sent, and the output ends before it.
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["🌊"])
    sent = ""
    for token in ids:
        delta = detokenizer.add([token])
        sent += delta.text
        if delta.stopped:
            break
    assert delta.stopped and sent == text[:text.index("🌊")]


def test_stop_strings_end_the_output_before_them_and_are_recorded_as_stop(served, llm):
    (reference,) = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    words = reference.text.split()
    stop = words[3]  # a word from the middle of the greedy output
    expected = reference.text[:reference.text.index(stop)]
    with httpx.Client(base_url=served.url, timeout=120) as client:
        body = client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0,
                                                    "stop": [stop]}, headers={"x-request-id": "stop-1"}).json()
    assert body["choices"][0]["text"] == expected and body["choices"][0]["finish_reason"] == "stop"
    _, events = post_stream(served.url, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 24,
                                                            "temperature": 0, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    (record,) = [r for r in served.records if r["request_id"] == "stop-1"]
    assert record["finish_reason"] == "stop" and record["error"] is None
    assert record["num_output_tokens"] == body["usage"]["completion_tokens"] == len(record["token_times"])


def test_seeded_sampling_is_reproducible_and_logprobs_come_in_openai_layout(served):
    client = served.openai()
    runs = [client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0.9, top_p=0.9,
                                      seed=7, extra_body={"top_k": 40}) for _ in range(2)]
    assert runs[0].choices[0].text == runs[1].choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 and item.logprob <= 0 for item in content)
    assert all(item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob for item in content)


# -- SSE framing and the usage rules --------------------------------------------------------------------------------

def test_sse_framing_and_usage_chunk_only_when_asked(served):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    response, events = post_stream(served.url, "/v1/completions", body)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert all(e["choices"] for e in events) and not any("usage" in e for e in events)
    for event in events:
        assert set(event) == {"id", "object", "created", "model", "choices"}
        assert event["object"] == "text_completion" and event["model"] == MODEL and event["id"] == events[0]["id"]
        assert set(event["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (len(events) - 1) + ["length"]

    _, events = post_stream(served.url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    *chunks, last = events
    assert last["choices"] == [] and not any("usage" in c for c in chunks)
    assert last["usage"]["completion_tokens"] == 5
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 5
    assert "cached_tokens" in last["usage"]["prompt_tokens_details"]

    _, events = post_stream(served.url, "/v1/completions", {
        **body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts == list(range(1, 6)) and events[-1]["choices"] == []

    _, events = post_stream(served.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True})
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_cached_tokens_come_from_the_prefix_cache(served):
    shared = list(range(1000, 1064))  # four full blocks, then the request's own tail
    usages = []
    with httpx.Client(base_url=served.url, timeout=120) as client:
        for tail in ([7, 8, 9], [10, 11, 12]):
            response = client.post("/v1/completions", json={"prompt": shared + tail, "max_tokens": 2})
            usages.append(response.json()["usage"])
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 64


def test_the_request_id_comes_from_x_request_id_and_batches_get_one_choice_per_prompt(served):
    with httpx.Client(base_url=served.url, timeout=120) as client:
        response = client.post("/v1/completions", json={"prompt": PROMPTS[:2], "max_tokens": 3},
                               headers={"x-request-id": "batch-7"})
    body = response.json()
    assert body["id"] == "batch-7" and response.headers["x-request-id"] == "batch-7"
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] <= 6
    assert {"batch-7-0", "batch-7-1"} <= {r["request_id"] for r in served.records}


def test_models_health_and_metrics(served):
    with httpx.Client(base_url=served.url, timeout=60) as client:
        models = client.get("/v1/models").json()
        assert models["data"][0]["id"] == MODEL and models["data"][0]["root"] == str(served.state.engine.model_dir)
        assert client.get("/health").status_code == 200
        client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2})
        text = client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "nanovllm:engine_info", "nanovllm:requests_ended_total",
                 "nanovllm:time_to_first_token_seconds_bucket", "nanovllm:step_duration_seconds_bucket"):
        assert f"\n{name}{{" in text, name
    generated = [line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")]
    assert float(generated[0].rsplit(" ", 1)[1]) >= 2
    assert 'nanovllm:engine_info{allocator="prefix",model_name="smollm2-test",policy="fcfs"} 1.0' in text


# -- nothing lost, clear errors ------------------------------------------------------------------------------------

_LONG = list(range(100, 1100))  # 1,000 tokens: with max_tokens 64 past max_model_len (1,024)
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": [1, "two"]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": _LONG, "max_tokens": 64}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
]


def test_malformed_requests_get_400_naming_the_field_and_disturb_nothing_in_flight(served, llm):
    (reference,) = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                                use_tqdm=False)
    with httpx.Client(base_url=served.url, timeout=120) as client, \
            client.stream("POST", "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 48,
                                                           "temperature": 0, "ignore_eos": True,
                                                           "stream": True}) as in_flight:
        lines = in_flight.iter_lines()
        first = next(line for line in lines if line)  # the request is running
        for path, body, param in BAD_REQUESTS:
            response = client.post(path, json=body)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert error["param"] == param and param in error["message"], (body, error)
        response = client.post("/v1/completions", content=b'{"prompt": "x", ', headers={
            "content-type": "application/json"})
        assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
        response = client.post("/v1/completions", json={"model": "gpt-5", "prompt": "x"})
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
        assert client.get("/v1/nope").status_code == 404
        rest = [first] + [line for line in lines if line]
    events = sse_events("".join(f"{line}\n\n" for line in rest))
    assert "".join(e["choices"][0]["text"] for e in events) == reference.text


def test_too_many_logprobs_fail_at_submission_in_python_too(llm):
    # SamplingParams itself takes any k >= 0; the engine's cap (engine.max_logprobs) refuses it before it runs.
    with pytest.raises(ValueError, match=r"logprobs must be <= max_logprobs \(20"):
        llm.generate(["a", "b"], SamplingParams(logprobs=10**9, max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    (output,) = llm.generate(["a"], SamplingParams(logprobs=20, max_tokens=2, temperature=0), use_tqdm=False)
    assert all(len(entry) >= 20 for entry in output.logprobs)
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0"):
        EngineConfig(max_logprobs=-1)


def test_a_client_that_disconnects_mid_stream_is_aborted_and_its_blocks_freed(served):
    with httpx.Client(base_url=served.url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 400,
                                                            "ignore_eos": True, "stream": True},
                           headers={"x-request-id": "gone-1"}) as response:
            received = 0
            for line in response.iter_lines():
                received += line.startswith("data: ")
                if received == 3:
                    break  # leaving the block closes the connection mid-stream
    wait_for(lambda: any(r["request_id"] == "gone-1" for r in served.records), "the aborted request recorded")
    (record,) = [r for r in served.records if r["request_id"] == "gone-1"]
    assert record["finish_reason"] == "abort" and record["error"] == "client disconnected"
    assert 3 <= record["num_output_tokens"] < 400
    wait_for(lambda: no_blocks_in_use(served), "every KV block free")


def test_a_full_queue_answers_503_with_retry_after(llm, tmp_path):
    # One running request at a time and one place in the queue: A runs, B waits, C is refused.
    served = serve_in_thread(tmp_path / "run", ServerConfig(port=0, max_waiting=1, retry_after_s=3),
                             allocator="paged", num_kv_blocks=64, max_model_len=512, max_num_seqs=1)
    try:
        async def scenario() -> tuple[httpx.Response, httpx.Response, list[str]]:
            async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
                a_lines: list[str] = []

                async def request_a() -> None:
                    async with client.stream("POST", "/v1/completions", json={
                            "prompt": PROMPTS[0], "max_tokens": 40, "ignore_eos": True, "stream": True}) as response:
                        async for line in response.aiter_lines():
                            a_lines.append(line)

                a = asyncio.create_task(request_a())
                while not any(line.startswith("data: {") for line in a_lines):
                    await asyncio.sleep(0.01)  # A has its first token: it is running
                b = asyncio.create_task(client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 2}))
                while served.state.engine_loop.num_waiting() < 1:
                    await asyncio.sleep(0.01)  # B is queued behind A
                c = await client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 2})
                await a
                return c, await b, a_lines

        refused, queued, a_lines = asyncio.run(scenario())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "3"
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert "max_waiting" in refused.json()["error"]["message"]
        assert queued.status_code == 200 and queued.json()["choices"][0]["finish_reason"] in ("stop", "length")
        events = sse_events("".join(f"{line}\n\n" for line in a_lines if line))
        assert events[-1]["choices"][0]["finish_reason"] == "length" and len(events) == 40
        assert len(served.records) == 2  # the refused request never entered the engine
    finally:
        stop_served(served)


def test_200_concurrent_streams_all_end_complete_and_match_the_server_records(served):
    num_requests, max_tokens = 200, 6
    before = {r["request_id"] for r in served.records}

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, dict[str, Any]]:
        request_id = f"load-{i}"
        try:
            async with client.stream("POST", "/v1/completions", headers={"x-request-id": request_id}, json={
                    "prompt": [200 + i % 50, 300 + i, 400], "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0.8, "seed": i, "stream": True,
                    "stream_options": {"include_usage": True}}) as response:
                raw = "".join([f"{line}\n\n" async for line in response.aiter_lines() if line])
                if response.status_code != 200:
                    return request_id, {"error": f"HTTP {response.status_code}"}
        except httpx.HTTPError as exc:
            return request_id, {"error": f"{type(exc).__name__}: {exc}"}
        events = sse_events(raw)
        return request_id, {"text": "".join(e["choices"][0]["text"] for e in events[:-1]),
                            "finish_reason": events[-2]["choices"][0]["finish_reason"],
                            "usage": events[-1]["usage"], "chunks": len(events) - 1}

    async def load() -> dict[str, dict[str, Any]]:
        limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=num_requests)
        async with httpx.AsyncClient(base_url=served.url, timeout=300, limits=limits) as client:
            return dict(await asyncio.gather(*(one(client, i) for i in range(num_requests))))

    results = asyncio.run(load())
    assert len(results) == num_requests
    assert not [r["error"] for r in results.values() if "error" in r]  # every request got its full output
    assert all(r["finish_reason"] == "length" and r["usage"]["completion_tokens"] == max_tokens
               and r["chunks"] == max_tokens for r in results.values())
    wait_for(lambda: no_blocks_in_use(served), "every KV block free after the load")
    records = {r["request_id"]: r for r in served.records if r["request_id"] not in before}
    assert set(records) == set(results)
    for request_id, record in records.items():
        assert record["finish_reason"] == "length" and record["error"] is None
        assert record["num_output_tokens"] == results[request_id]["usage"]["completion_tokens"]
        assert record["num_prompt_tokens"] == results[request_id]["usage"]["prompt_tokens"] == 3
    on_disk = {r["request_id"] for r in read_jsonl(served.run_dir / "requests.jsonl")}
    assert set(results) <= on_disk
    peak = max(s["num_running"] for s in served.state.engine_loop.steps)
    assert peak > 1  # requests of different connections were batched together


def test_runner_http_against_this_server_writes_the_records_of_an_in_process_run(served, tmp_path):
    run_dir = tmp_path / "client_run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([
        sys.executable, "-m", "nanovllm.run", "runner=http", f"runner.url={served.url}/v1", "workload=synthetic",
        "workload.num_requests=8", "workload.request_rate=20", "workload.input_len.kind=uniform",
        "workload.input_len.mean=12", "workload.input_len.range_ratio=0.5", "workload.output_len.kind=uniform",
        "workload.output_len.mean=6", "workload.output_len.range_ratio=0.5", "workload.priority_classes=[0,1]",
        "workload.priority_weights=[0.5,0.5]", f"hydra.run.dir={run_dir}", "progress=false",
    ], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Serving Benchmark Result" in proc.stdout
    requests = read_jsonl(run_dir / "requests.jsonl")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert len(requests) == 8 and all(set(r) == set(RequestRecord.__annotations__) for r in requests)
    in_process_keys = set(summarize([])) | {"mfu", "mbu", "warmup_time_s", "warmup_steps", "machine", "breakdowns"}
    assert in_process_keys <= set(metrics) and metrics["completed"] == 8 and metrics["runner"] == "http"
    assert set(metrics["breakdowns"]["priority"]) == {"0", "1"}
    server_side = {r["request_id"]: r for r in served.records}
    for record in requests:  # exact lengths: token-id prompts with ignore_eos and max_tokens
        mirror = server_side[record["request_id"]]
        assert record["num_output_tokens"] == mirror["num_output_tokens"] == len(record["token_times"])
        assert record["num_prompt_tokens"] == mirror["num_prompt_tokens"]
        assert record["priority"] == mirror["priority"]
        assert record["first_token_time"] <= record["finish_time"]


class _FailsOnItsFifthStep(Policy):
    """A policy that raises in its fifth step: the engine is broken from then on."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step(self, scheduled, now) -> None:
        self.steps += 1
        if self.steps == 5:
            raise RuntimeError("policy bug")


def test_an_engine_fault_ends_every_request_with_its_reason_and_the_server_refuses_more(llm, tmp_path):
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=512, warmup=False),
                       scheduler=_FailsOnItsFifthStep())
    files = JsonlLogger()
    files.start(tmp_path, {})
    state = ServerState(engine, ServerConfig(port=0), MODEL, ServerMetrics(MODEL, "fails", "paged"), loggers=[files])
    served = Served(start_in_thread(state), state, tmp_path)
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 40, "ignore_eos": True}
        with httpx.Client(base_url=served.url, timeout=120) as client:
            streamed = client.post("/v1/completions", json={**body, "stream": True}, headers={"x-request-id": "s"})
            events = sse_events(streamed.text)
            assert "policy bug" in events[-1]["error"]["message"]  # the stream ends with the error object
            wait_for(lambda: client.get("/health").status_code == 503, "/health says the engine failed")
            refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 503 and "policy bug" in refused.json()["error"]["message"]
    finally:
        served.running.stop()
        files.finish()
    (record,) = read_jsonl(tmp_path / "requests.jsonl")
    assert record["request_id"] == "s" and record["finish_reason"] == "abort"
    assert record["error"].startswith("engine fault: PolicyError")
