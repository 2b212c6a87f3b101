"""The routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus) and ``POST /run/summary`` (write ``metrics.json`` now and return the summary).

A route validates the body (``protocol``), makes the engine requests (``EngineLoop.make_request``: every one of
them before any is queued, as ``LLM.generate`` does), hands them to the ``EngineLoop`` and answers from their
deltas: one JSON body, or server-sent events (``data: {chunk}\\n\\n`` per chunk, ``data: [DONE]\\n\\n`` last). A
client that goes away mid-request has its requests aborted at once (their blocks freed, recorded as aborted
with reason ``client disconnected``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanovllm.chat_template import chat_token_ids
from nanovllm.engine.protocol import EngineClient
from nanovllm.request import Request as EngineRequest
from nanovllm.sampling import SamplingParams
from nanovllm.server import errors
from nanovllm.server.config import ServerConfig
from nanovllm.server.engine_loop import Delta, DuplicateRequestId, EngineLoop, QueueFull, ShuttingDown
from nanovllm.server.errors import OpenAIError, engine_value_error
from nanovllm.server.prometheus import CONTENT_TYPE_LATEST, ServerMetrics
from nanovllm.serving.loggers import RunLogger
from nanovllm.serving.metrics import SLO
from nanovllm.serving.monitor import Monitor
from nanovllm.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
)
from nanovllm.server.responses import ChatFormat, Choice, CompletionFormat, ResponseFormat, usage

DISCONNECTED_REASON = "client disconnected"


@dataclass
class ServerState:
    """What the routes share: the engine, its loop (started with the app), the options and the figures. The
    routes reach the engine only through its loop (``running_loop()``); they read the model's tokenizer and the
    engine's fixed limits, which no step changes."""

    engine: EngineClient
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    loggers: list[RunLogger] = field(default_factory=list)
    monitor: Monitor | None = None
    slo: SLO | None = None
    engine_loop: EngineLoop | None = None

    @property
    def model_root(self) -> str:
        return str(self.engine.model_dir)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, for chat templates and logprob tokens (the engine thread has its own copy)."""
        return self.engine.tokenizer

    def running_loop(self) -> EngineLoop:
        if self.engine_loop is None:
            raise OpenAIError(503, "the server is starting", headers=self.retry_after)
        return self.engine_loop

    @property
    def retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.config.retry_after_s)}

    def start(self) -> None:
        """Start the engine loop on the running event loop (the app's start-up)."""
        if self.engine_loop is None:
            self.engine_loop = EngineLoop(self.engine, asyncio.get_running_loop(), loggers=self.loggers,
                                          metrics=self.metrics, monitor=self.monitor,
                                          max_waiting=self.config.max_waiting, slo=self.slo,
                                          window=self.config.records_window)
            self.engine_loop.start()

    async def stop(self) -> None:
        """Let the requests in flight run for ``server.drain_timeout`` seconds at most, end those still in flight
        (aborted, reason ``interrupted``) and stop the engine loop; their streams get their final chunks. Called
        before the HTTP server waits for its connections to close."""
        if self.engine_loop is not None:
            await asyncio.to_thread(self.engine_loop.stop, None, self.config.drain_timeout)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over ``state``; its lifespan starts the engine loop and stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="nano-vllm", lifespan=lifespan)
    app.state.server = state
    errors.install(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_checker(state.config.api_key))])

    @app.get("/health")
    async def health() -> Response:
        loop = state.engine_loop
        if loop is None or loop.fault is not None or loop.stopping:
            reason = "starting" if loop is None else loop.fault or "shutting down"
            return OpenAIError(503, f"not serving: {reason}", headers=state.retry_after).response()
        replicas = getattr(state.engine, "replicas", None)
        if replicas is not None and not any(replica.alive for replica in replicas):
            return OpenAIError(503, "not serving: no replica is alive", headers=state.retry_after).response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "nanovllm",
            "root": state.model_root, "parent": None, "max_model_len": state.max_model_len}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        params = _sampling(body, body.requested_max_tokens() or DEFAULT_COMPLETION_MAX_TOKENS, body.logprobs)
        response_id = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        engine_requests = _make_requests(state, body.prompts(), params, response_id, body.priority)
        fmt = CompletionFormat(response_id, state.model_name, state.tokenizer, body.logprobs)
        return await _answer(state, request, body, engine_requests, fmt)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        try:
            prompt = chat_token_ids(state.tokenizer, [m.as_template_message() for m in body.messages])
        except Exception as exc:  # the model's template refuses the conversation (e.g. roles out of order)
            raise OpenAIError(400, f"messages: the chat template failed: {exc}", param="messages") from None
        max_tokens = body.requested_max_tokens() or _room_left(state.running_loop().limits, len(prompt))
        params = _sampling(body, max_tokens, body.engine_logprobs(), rename={"logprobs": "top_logprobs"})
        response_id = request.headers.get("x-request-id") or f"chatcmpl-{uuid.uuid4().hex}"
        engine_requests = _make_requests(state, [prompt], params, response_id, body.priority,
                                         rename={"logprobs": "top_logprobs"})
        fmt = ChatFormat(response_id, state.model_name, state.tokenizer, body.engine_logprobs())
        return await _answer(state, request, body, engine_requests, fmt)

    @app.post("/run/summary", dependencies=[Depends(_api_key_checker(state.config.api_key))])
    async def run_summary() -> JSONResponse:
        """Write the run's ``metrics.json`` now (through the loggers) and return the summary."""
        loop = state.running_loop()
        return JSONResponse(json.loads(json.dumps(await loop.call(loop.write_summary), default=str)))

    app.include_router(v1)
    return app


# -- checks ------------------------------------------------------------------------------------------------------

def _api_key_checker(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise OpenAIError(401, "invalid API key: send Authorization: Bearer <server.api_key>",
                              code="invalid_api_key")
    return check


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in (state.model_name, state.model_root):
        raise OpenAIError(404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                          param="model", code="model_not_found")


def _room_left(limits: tuple[int, int, int], num_prompt_tokens: int) -> int:
    """OpenAI's default ``max_tokens`` for chat: what the context has left after the prompt, here also what the
    whole KV cache can hold (at least one, so that a prompt that fills either is refused for its length).
    ``limits``: ``EngineLoop.limits``."""
    max_model_len, num_kv_blocks, block_size = limits
    capacity = min(max_model_len, num_kv_blocks * block_size)
    return max(1, capacity - num_prompt_tokens)


def _sampling(body: GenerationRequest, max_tokens: int, logprobs: int | None,
              rename: dict[str, str] | None = None) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as exc:
        raise engine_value_error(exc, rename) from None


def _make_requests(state: ServerState, prompts: Sequence[str | list[int]], params: SamplingParams,
                   response_id: str, priority: int, rename: dict[str, str] | None = None) -> list[EngineRequest]:
    """One validated engine request per prompt (ids ``<response_id>`` or ``<response_id>-<i>`` for a batch)."""
    requests = []
    for i, prompt in enumerate(prompts):
        request_id = response_id if len(prompts) == 1 else f"{response_id}-{i}"
        try:
            requests.append(state.running_loop().make_request(prompt, params, priority=priority,
                                                               request_id=request_id))
        except ValueError as exc:
            error = engine_value_error(exc, rename)
            if len(prompts) > 1:
                error.message = f"prompt[{i}]: {error.message}"
            raise error from None
    return requests


# -- answering ---------------------------------------------------------------------------------------------------

class _Exchange:
    """The requests of one HTTP request, from submission until each has ended or been aborted."""

    def __init__(self, state: ServerState, http: Request, requests: list[EngineRequest]) -> None:
        self.loop = state.running_loop()
        self.http = http
        self.requests = requests
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = [Choice() for _ in requests]
        self._closed = False
        self._watcher: asyncio.Task | None = None

    def submit(self, stop: Sequence[str], retry_after: dict[str, str], timeout: float | None = None) -> None:
        submitted = []
        try:
            for index, request in enumerate(self.requests):
                self.loop.submit(request, self.queue, index, stop, timeout)
                submitted.append(request)
        except (QueueFull, ShuttingDown, DuplicateRequestId) as exc:
            for request in submitted:  # all or nothing: a batch half queued is no answer
                self.loop.abort(request.request_id, f"refused: {exc}")
            if isinstance(exc, DuplicateRequestId):
                raise OpenAIError(400, str(exc), param="x-request-id") from None
            raise OpenAIError(503, str(exc), headers=retry_after) from None
        self._watcher = asyncio.create_task(self._watch_disconnect())

    async def _watch_disconnect(self) -> None:
        # The body has been read: the next message is http.disconnect, when the client goes (or the response
        # is complete, by which time this task is cancelled).
        message = await self.http.receive()
        while message["type"] != "http.disconnect":
            message = await self.http.receive()
        self.close(DISCONNECTED_REASON)

    async def next(self) -> tuple[int, Delta]:
        index, delta = await self.queue.get()
        self.choices[index].add(delta)
        return index, delta

    @property
    def done(self) -> bool:
        return all(choice.done for choice in self.choices)

    def close(self, reason: str = DISCONNECTED_REASON) -> None:
        """Stop watching; abort whatever has not ended (once)."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
        for request, choice in zip(self.requests, self.choices):
            if not choice.done:
                self.loop.abort(request.request_id, reason)


async def _answer(state: ServerState, http: Request, body: GenerationRequest, requests: list[EngineRequest],
                  fmt: ResponseFormat) -> Response:
    exchange = _Exchange(state, http, requests)
    timeout = body.timeout if body.timeout is not None else state.config.request_timeout
    exchange.submit(body.stop_strings, state.retry_after, timeout)
    headers = {"x-request-id": fmt.id}
    if body.stream:
        return StreamingResponse(_sse(exchange, body, fmt), media_type="text/event-stream", headers=headers)
    try:
        while not exchange.done:
            await exchange.next()
    finally:
        exchange.close()
    failed = [c.last for c in exchange.choices if c.last is not None and c.last.error is not None]
    if failed:
        if failed[0].timed_out:
            raise OpenAIError(408, f"the request {failed[0].error}", param="timeout", code="timeout")
        raise OpenAIError(500, f"the request failed: {failed[0].error}")
    return JSONResponse(fmt.response(exchange.choices), headers=headers)


async def _sse(exchange: _Exchange, body: GenerationRequest, fmt: ResponseFormat) -> AsyncIterator[str]:
    """The stream of one HTTP request: each choice's chunks as its tokens come, the usage chunk when asked for,
    then ``[DONE]``. Cancelled when the client disconnects: ``finally`` aborts what is unfinished."""
    opened: set[int] = set()
    offsets = [0] * len(exchange.choices)
    continuous = body.include_usage and body.continuous_usage
    try:
        while not exchange.done:
            index, delta = await exchange.next()
            if delta.error is not None:
                yield _event(errors.error_body(408, f"the request {delta.error}", "timeout", "timeout")
                             if delta.timed_out else errors.error_body(500, f"the request failed: {delta.error}"))
                continue
            chunk = fmt.chunk(index, delta, offsets[index])
            if chunk is None:
                continue
            offsets[index] += len(delta.text)
            if index not in opened:  # a chat choice opens with its role, sent with its first token
                opened.add(index)
                for opening in fmt.opening_chunks(len(exchange.choices))[index:index + 1]:
                    yield _event(opening)
            if continuous:
                chunk["usage"] = _usage_of(delta)
            yield _event(chunk)
        if body.include_usage:
            yield _event(fmt.usage_chunk(exchange.choices))
        yield "data: [DONE]\n\n"
    finally:
        exchange.close()


def _usage_of(delta: Delta) -> dict[str, Any]:
    return usage(delta.prompt_tokens, delta.completion_tokens, delta.cached_tokens)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
