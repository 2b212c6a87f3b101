"""``runner=http``: the same workloads, sent over HTTP to any OpenAI-compatible server (nano-vllm's
``python -m nanovllm.serve``, vLLM's, anyone's), measured on the client side into the same records::

    python -m nanovllm.run runner=http runner.url=http://127.0.0.1:8000/v1 workload=synthetic \\
        workload.num_requests=64 workload.request_rate=4

Each request is sent when its workload arrival time comes (or, with ``runner.max_concurrency``, when a slot is
free), streamed (``stream_options.include_usage`` and ``continuous_usage_stats``, so every chunk says how many
tokens have been generated), and recorded as a ``RequestRecord`` with the keys of an in-process run:
``arrival_time`` is when it was sent, ``token_times`` when each token's chunk arrived, ``first_token_time`` the
first of them, ``finish_time`` the last; the usage gives the prompt, output and prefix-cached token counts.
What only the engine knows (``first_scheduled_time``, preemptions, recompute) is None / 0, and there are no
steps. ``metrics.summarize`` over these records is the same summary table (TTFT, TPOT, ITL, E2EL) as an
in-process run's, so one table compares engines. A request the server refuses or fails is recorded as failed
with the status and message; nothing is dropped.

Token-id prompts (synthetic and trace workloads) go as ``prompt: [ids]`` with ``max_tokens`` and
``ignore_eos``, so lengths are exact on servers that honour them (vLLM and nano-vllm do); ``runner.endpoint=chat``
sends the chat workload's ``messages`` instead. The tokenizer (``model.path``, else the default model's) turns
text prompts into ids where the workload needs them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import httpx

from nanovllm.harness.interrupt import STOP
from nanovllm.harness.option_types import plugin_spec
from nanovllm.harness.sim.this_machine import this_machine
from nanovllm.harness.workload import WorkloadRequest, generate_workload, validate_workload_config
from nanovllm.progress import RequestProgress
from nanovllm.serving.loggers import LOGGERS, RunLogger, configured_loggers
from nanovllm.serving.metrics import SLO, format_summary, summarize_with_breakdowns
from nanovllm.serving.records import RequestRecord

ENDPOINTS = ("completions", "chat")
# httpx logs every request at INFO: at hundreds of requests that would flood the run's log.
logging.getLogger("httpx").setLevel(logging.WARNING)
INTERRUPTED_REASON = "interrupted"


@dataclass
class HttpRunnerConfig:
    """``conf/runner/http.yaml``. ``url``: the API's base (ending in ``/v1``). ``model``: the name to send
    (null: the server's first, from ``GET /models``). ``max_concurrency``: requests in flight at most (null:
    every request is sent at its arrival time, as ``vllm bench serve`` does without ``--max-concurrency``)."""

    name: str = "http"
    url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "completions"
    max_concurrency: int | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"runner.url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {self.url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"runner.endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.max_concurrency is not None and (not isinstance(self.max_concurrency, int)
                                                 or self.max_concurrency < 1):
            raise ValueError(f"runner.max_concurrency must be an integer >= 1 or null, got {self.max_concurrency!r}")
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"runner.timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")


@dataclass
class HttpRunResult:
    """What ``serve_over_http`` produced: the records (in the order requests ended), summary and breakdowns."""

    requests: list[RequestRecord]
    summary: dict[str, Any]
    breakdowns: dict[str, dict[str, dict[str, Any]]]
    output_texts: dict[str, str]


def serve_over_http(config: HttpRunnerConfig, workload: Sequence[WorkloadRequest], *, temperature: float = 0.0,
                    loggers: Sequence[RunLogger] = (), slo: SLO | None = None, progress: bool = False,
                    stop: threading.Event | None = None,
                    annotations: Mapping[str, Any] | None = None) -> HttpRunResult:
    """Send ``workload`` to ``config.url`` in real time and return the client-side records and summary (the
    HTTP counterpart of ``serving.serve``). ``loggers`` get every request as it ends and the summary; their
    ``start`` / ``finish`` are the caller's. ``stop`` (set on SIGINT / SIGTERM) ends the run: what is in flight
    is cancelled and recorded as aborted (``interrupted``), what has not been sent is only counted.
    ``annotations`` are added to the summary (the client's machine, for ``python -m nanovllm.run``)."""
    if config.endpoint == "chat" and any(w.messages is None for w in workload):
        raise ValueError("runner.endpoint=chat needs a workload with messages (workload=chat); other workloads "
                         "send token ids to runner.endpoint=completions")
    run = _HttpRun(config, workload, temperature, loggers, slo, progress, stop, dict(annotations or {}))
    return asyncio.run(run.run())


class _HttpRun:
    def __init__(self, config: HttpRunnerConfig, workload: Sequence[WorkloadRequest], temperature: float,
                 loggers: Sequence[RunLogger], slo: SLO | None, progress: bool,
                 stop: threading.Event | None, annotations: dict[str, Any]) -> None:
        self.config = config
        self.workload = list(workload)
        self.temperature = temperature
        self.loggers = loggers
        self.slo = slo
        self.stop = stop
        self.annotations = annotations
        self.progress = RequestProgress(len(self.workload), disable=not progress)
        self.records: list[RequestRecord] = []
        self.texts: dict[str, str] = {}
        self.sent = 0
        self.t0 = 0.0

    async def run(self) -> HttpRunResult:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        # One connection per request in flight: httpx's default pool (100) would queue the rest client-side.
        limit = self.config.max_concurrency or max(1, len(self.workload))
        limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
        async with httpx.AsyncClient(base_url=self.config.base_url, headers=headers, limits=limits,
                                     timeout=httpx.Timeout(self.config.timeout_s)) as client:
            model = self.config.model or await _first_model(client, self.config.base_url)
            semaphore = asyncio.Semaphore(self.config.max_concurrency) if self.config.max_concurrency else None
            self.t0 = time.perf_counter()
            tasks = [asyncio.create_task(self._one(client, model, i, w, semaphore))
                     for i, w in enumerate(self.workload)]
            interrupted = await self._wait(tasks)
        self.progress.close()
        summary, breakdowns = summarize_with_breakdowns(self.records, (), ("priority", "client_id"), slo=self.slo)
        # The keys an in-process run has and a client cannot know stay, as None, so tables line up.
        summary.update(mfu=None, mbu=None, warmup_time_s=None, warmup_steps=None, runner="http",
                       url=self.config.url, model=model, **self.annotations)
        if interrupted:
            summary.update(interrupted=True, not_arrived=len(self.workload) - self.sent)
        for run_logger in self.loggers:
            run_logger.log_summary(summary, breakdowns)
        return HttpRunResult(self.records, summary, breakdowns, self.texts)

    async def _wait(self, tasks: list[asyncio.Task]) -> bool:
        """Until every request ended, or ``stop`` was set (then cancel the rest). True when interrupted."""
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.1)
            if pending and self.stop is not None and self.stop.is_set():
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return True
        for task in tasks:
            task.result()  # a bug in the client itself is raised, not swallowed
        return False

    async def _one(self, client: httpx.AsyncClient, model: str, index: int, w: WorkloadRequest,
                   semaphore: asyncio.Semaphore | None) -> None:
        await asyncio.sleep(max(0.0, self.t0 + w.arrival_time - time.perf_counter()))
        if semaphore is not None:
            async with semaphore:
                await self._send(client, model, index, w)
        else:
            await self._send(client, model, index, w)

    async def _send(self, client: httpx.AsyncClient, model: str, index: int, w: WorkloadRequest) -> None:
        request_id = w.request_id if w.request_id is not None else str(index)
        self.sent += 1
        stream = _StreamState(request_id, w, time.perf_counter() - self.t0)
        path, payload = self._payload(model, w)
        try:
            async with client.stream("POST", path, json=payload, headers={"x-request-id": request_id}) as response:
                if response.status_code != 200:
                    await response.aread()
                    stream.fail(f"HTTP {response.status_code}: {_error_message(response)}", self._now())
                else:
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and stream.add(line[len("data: "):], self._now()):
                            break
        except asyncio.CancelledError:
            stream.abort(INTERRUPTED_REASON, self._now())
            self._ended(stream)
            raise
        except httpx.HTTPError as exc:
            stream.fail(f"{type(exc).__name__}: {exc}", self._now())
        self._ended(stream)

    def _payload(self, model: str, w: WorkloadRequest) -> tuple[str, dict[str, Any]]:
        payload: dict[str, Any] = {
            "model": model, "max_tokens": w.max_tokens, "temperature": self.temperature, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if w.ignore_eos:
            payload["ignore_eos"] = True
        if w.priority:  # vLLM refuses a priority unless it schedules by priority: send it only when it matters
            payload["priority"] = w.priority
        if self.config.endpoint == "chat":
            return "/chat/completions", {**payload, "messages": w.messages}
        return "/completions", {**payload, "prompt": w.prompt}

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _ended(self, stream: "_StreamState") -> None:
        record = stream.record()
        self.records.append(record)
        self.texts[record["request_id"]] = stream.text
        for run_logger in self.loggers:
            run_logger.log_request(record)
        self.progress.update(len(self.records), sum(r["num_output_tokens"] for r in self.records))


class _StreamState:
    """One request's stream as the client sees it, turned into a ``RequestRecord`` at the end."""

    def __init__(self, request_id: str, w: WorkloadRequest, sent_at: float) -> None:
        self.request_id = request_id
        self.w = w
        self.sent_at = sent_at
        self.token_times: list[float] = []
        self.text = ""
        self.usage: dict[str, Any] = {}
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.finish_time: float | None = None

    def add(self, data: str, now: float) -> bool:
        """One SSE event; True at ``[DONE]``."""
        if data.strip() == "[DONE]":
            self.finish_time = self.finish_time if self.finish_time is not None else now
            return True
        event = json.loads(data)
        if "error" in event:
            self.fail(str(event["error"].get("message", event["error"])), now)
            return False
        before = len(self.token_times)
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or []:
            self.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.finish_time = now
        if event.get("choices"):
            # With continuous usage stats every chunk says how many tokens exist so far; without, a chunk that
            # carries text is one token (as vllm bench serve counts).
            generated = self.usage.get("completion_tokens") if event.get("usage") else None
            if generated is None:
                generated = before + int(any((c.get("text") or (c.get("delta") or {}).get("content"))
                                             for c in event["choices"]))
            self.token_times += [now] * max(0, generated - before)
        return False

    def fail(self, error: str, now: float) -> None:
        self.error, self.finish_reason, self.finish_time = error, None, now

    def abort(self, reason: str, now: float) -> None:
        self.error, self.finish_reason, self.finish_time = reason, "abort", now

    def record(self) -> RequestRecord:
        usage = self.usage
        details = usage.get("prompt_tokens_details") or {}
        prompt_tokens = usage.get("prompt_tokens")
        if prompt_tokens is None:
            prompt_tokens = len(self.w.prompt) if isinstance(self.w.prompt, list) else 0
        if self.error is None and self.finish_reason is None:
            self.fail("the stream ended without a finish reason", self.finish_time or self.sent_at)
        return RequestRecord(
            request_id=self.request_id, client_id=self.w.client_id, priority=self.w.priority,
            arrival_time=self.sent_at, first_scheduled_time=None,
            first_token_time=self.token_times[0] if self.token_times else None,
            finish_time=self.finish_time, token_times=list(self.token_times),
            num_prompt_tokens=prompt_tokens, num_cached_tokens=details.get("cached_tokens") or 0,
            num_output_tokens=usage.get("completion_tokens", len(self.token_times)),
            num_preemptions=0, num_recomputed_tokens=0,
            cached_tokens_by_tier=None, num_swapped_tokens=0,   # not in the OpenAI response: the server's records
            finish_reason=self.finish_reason, error=self.error,
            slo_ttft=None if self.w.ttft_slo_ms is None else self.w.ttft_slo_ms / 1000.0,
            slo_e2el=None if self.w.e2el_slo_ms is None else self.w.e2el_slo_ms / 1000.0,
            session_id=self.w.session_id, replica=None, prefill_replica=None, kv_transfer_bytes=None,
            kv_transfer_time=None, kv_arrival_time=None, decode_start_time=None, kv_transfer_failed=False,
            num_retries=0, retried_from=[],
            retry_recomputed_tokens=0,
            # Not in the OpenAI response either (the server's own records and /metrics carry them).
            spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0, spec_decode_num_accepted_tokens=0,
            spec_proposer_asks=0, spec_proposals=0, spec_proposal_tokens=0,
        )


async def _first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The server's first model (``GET /models``), the name to send when ``runner.model`` is not set."""
    try:
        response = await client.get("/models")
    except httpx.HTTPError as exc:
        raise ValueError(f"runner.url={base_url}: cannot reach the server ({type(exc).__name__}: {exc})") from None
    if response.status_code != 200:
        raise ValueError(f"runner.url={base_url}: GET /models answered HTTP {response.status_code}: "
                         f"{_error_message(response)}")
    return response.json()["data"][0]["id"]


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("message", error)) if isinstance(error, dict) else str(body)[:500]


def run_over_http(cfg: Any, hc: Any) -> dict[str, Any]:
    """``python -m nanovllm.run runner=http``: the configured workload, logger and SLO, sent to ``runner.url``,
    written into Hydra's run directory (``hc``: its ``HydraConfig``). Called by the hook at the top of
    ``harness/run.py``'s ``run``. Loads only the tokenizer: the model is the server's."""
    from pathlib import Path

    from hydra.types import RunMode
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    # The model package imports torch: only when a run over HTTP starts (it loads the tokenizer only).
    from nanovllm.models.loader import resolve_model

    config = HttpRunnerConfig(**OmegaConf.to_container(cfg.runner, resolve=True))
    validate_workload_config(cfg.workload)
    slo = SLO(**cfg.slo)
    if cfg.live.mode != "off":
        raise ValueError(f"live={cfg.live.mode} watches an engine in this process; with runner=http the engine is "
                         "the server's (python -m nanovllm.serve live=web watches it there)")
    loggers = configured_loggers(plugin_spec(LOGGERS, cfg.logger, "logger"))
    STOP.starting("loading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(cfg.model.path), trust_remote_code=False)
    workload = generate_workload(cfg.workload, tokenizer)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    # As an in-process run names itself: a sweep's jobs share a W&B group and are named by their overrides.
    group = (cfg.logger.get("group") or Path(str(hc.sweep.dir)).name) if multirun else None
    name = (hc.job.override_dirname or f"job{hc.job.num}") if multirun else run_dir.name
    started: list[RunLogger] = []
    try:
        for run_logger in loggers:
            run_logger.start(run_dir, resolved, group=group, name=name)
            started.append(run_logger)
        STOP.serving()
        result = serve_over_http(config, workload, temperature=cfg.temperature, loggers=loggers, slo=slo,
                                 progress=bool(cfg.progress) and not multirun, stop=STOP.event,
                                 annotations={"machine": this_machine()})
    finally:
        for run_logger in started:
            run_logger.finish()
    print(format_summary(result.summary, title=f"Serving Benchmark Result ({config.url})"))
    print(f"run files: {run_dir}")
    return result.summary
