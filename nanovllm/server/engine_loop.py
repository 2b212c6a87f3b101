"""The engine behind the HTTP routes: one thread steps one ``LLMEngine`` for as long as any request is
unfinished, admitting each HTTP request between steps as it comes (continuous batching across connections,
the same ``LLMEngine.step`` as ``python -m nanovllm.run``). The asyncio side never touches the engine while it
steps: it hands requests and aborts over under a lock, and gets each request's new text back through its own
``asyncio.Queue``, filled with one ``loop.call_soon_threadsafe`` per step.

After every step the thread turns the requests' new tokens into text deltas (``detokenizer``), ends a request
whose stop string appeared (before the next step, so no token is sampled past it), writes the step and every
ended request through the run's loggers (``records``: ``steps.jsonl``, ``requests.jsonl``, W&B, live views)
and updates the Prometheus figures. Every request ends exactly once: finished, aborted (a client that went
away, the server stopping) or failed, with its reason, and its stream always receives a final ``Delta``.

Memory stays bounded however long the server runs: the files get every record, but the loop holds only the last
``window`` request and step records (``server.records_window``), and the summary (``metrics.json``,
``POST /run/summary``) comes from running aggregates (``serving.aggregates``, ``StepTotals``), not from records.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import heapq
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from nanovllm.engine.protocol import EngineClient, StepError
from nanovllm.outputs import Logprob
from nanovllm.request import Request, RequestStatus
from nanovllm.sampling import SamplingParams
from nanovllm.server.detokenizer import IncrementalDetokenizer
from nanovllm.server.prometheus import ServerMetrics
from nanovllm.serving.aggregates import GroupedAggregates, RequestAggregates
from nanovllm.serving.loggers import RunLogger
from nanovllm.serving.loop import StepLoop
from nanovllm.serving.metrics import SLO
from nanovllm.serving.monitor import Monitor
from nanovllm.serving.records import RequestRecord
from nanovllm.serving.step_records import StepTotals

logger = logging.getLogger(__name__)

STOP_STRING_REASON = "stop string"   # how the engine's abort is told apart from a real one
INTERRUPTED_REASON = "interrupted"   # the server was stopped (SIGINT / SIGTERM) with the request in flight
CLUSTER_POLL_S = 0.005               # how long a cluster's step waits before new requests are let in
BREAKDOWN_FIELDS = ("priority", "client_id")   # metrics.json's breakdowns, as python -m nanovllm.run writes them


class QueueFull(Exception):
    """``server.max_waiting`` requests are already waiting for their first step (HTTP 503)."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new request (HTTP 503)."""


class DuplicateRequestId(ValueError):
    """A request id (``x-request-id``) that is already in flight (HTTP 400)."""


@dataclass
class Delta:
    """What one step added to one request: its new token ids and text, their logprobs when asked for, and
    the usage so far. The last ``Delta`` of a request has ``finish_reason`` ("stop", "length", "abort") or
    ``error`` (it failed: the reason)."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    timed_out: bool = False   # it failed because its deadline passed (HTTP 408)

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class _Tracked:
    """A request the loop serves, seen only by the engine thread (the asyncio side reads its queue)."""

    request: Request
    queue: asyncio.Queue                   # receives (index, Delta)
    index: int                             # the request's choice index in its HTTP response
    detokenizer: IncrementalDetokenizer
    num_sent: int = 0                      # output tokens already handed out
    stop_string_hit: bool = False
    deadline: float | None = None          # time.monotonic() past which it is aborted (its timeout)
    timeout: float | None = None
    timed_out: bool = False


@dataclass
class _Inbox:
    """What the asyncio side has handed over since the engine thread last looked (guarded by the lock)."""

    submitted: deque = field(default_factory=deque)     # _Tracked, in arrival order
    aborts: list[tuple[str, str]] = field(default_factory=list)      # (request_id, reason)
    calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = field(default_factory=list)


class _PrometheusFigures(RunLogger):
    """The server's Prometheus figures, fed like the run's other loggers: after each step and ended request."""

    def __init__(self, metrics: ServerMetrics, engine: EngineClient) -> None:
        self.metrics, self.engine = metrics, engine

    def log_step(self, step: Mapping[str, Any]) -> None:
        self.metrics.observe_step(step, self.engine)

    def log_request(self, record: Mapping[str, Any]) -> None:
        self.metrics.observe_request(record)


class _RunningFigures(RunLogger):
    """The run's summary figures, fed like a logger with every step and ended request and holding none of
    them: request aggregates (overall and per breakdown field) and step totals."""

    def __init__(self, slo: SLO | None) -> None:
        self.requests = RequestAggregates(slo)
        self.groups = {by: GroupedAggregates(by, slo) for by in BREAKDOWN_FIELDS}
        self.steps = StepTotals()

    def log_step(self, step: Mapping[str, Any]) -> None:
        self.steps.add(step)

    def log_request(self, record: Mapping[str, Any]) -> None:
        self.requests.add(record)  # type: ignore[arg-type]  # a RequestRecord, as StepLoop logs it
        for groups in self.groups.values():
            groups.add(record)


class EngineLoop:
    """Runs ``engine`` in a thread of its own for an asyncio server on ``loop``: the one way the HTTP handlers
    reach the engine.

    ``make_request`` / ``submit`` / ``abort`` / ``call`` are called from the event loop; ``start`` once when the
    server starts and ``stop`` once when it shuts down (it ends every request in flight, aborted with reason
    ``interrupted``). ``loggers`` get every step and ended request as it happens (their ``start`` / ``finish``
    are the caller's); the books are a ``StepLoop``'s, as every driver's are. ``window``: how many of the
    latest request and step records ``records`` and ``steps`` hold (None: all of them; a server passes
    ``server.records_window`` so that its memory stays bounded); the summary covers every one either way.
    """

    def __init__(self, engine: EngineClient, loop: asyncio.AbstractEventLoop, *,
                 loggers: Sequence[RunLogger] = (), metrics: ServerMetrics | None = None,
                 monitor: Monitor | None = None, max_waiting: int | None = None, slo: SLO | None = None,
                 window: int | None = None) -> None:
        self.engine = engine
        self.loop = loop
        self.loggers = list(loggers)
        self.max_waiting = max_waiting
        self.slo = slo
        figures = [_PrometheusFigures(metrics, engine)] if metrics is not None else []
        self.figures = _RunningFigures(slo)
        self.books = StepLoop(engine, loggers=[*self.loggers, *figures, self.figures], monitor=monitor,
                              on_ended=self._ended, window=window)
        self.fault: str | None = None          # set when a step raised: the engine is not to be trusted
        self._failing: str | None = None       # the reason every request in flight fails with, after a fault
        self._final: list[tuple[_Tracked, Delta]] = []   # the ended requests' last deltas, for this step
        # The engine thread detokenizes with a tokenizer of its own: the event loop tokenizes prompts with the
        # engine's at the same time, and a Rust tokenizer must not be borrowed by two threads at once.
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self._cond = threading.Condition()
        self._inbox = _Inbox()
        self._in_flight: set[str] = set()      # request ids submitted and not yet ended (under the lock)
        self._stopping = False
        self._draining = False                 # stopping: no new request, those in flight run on for a while
        self._tracked: dict[str, _Tracked] = {}
        self._deadlines: list[tuple[float, str]] = []   # (deadline, request id) of tracked requests: a heap
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)

    # -- the asyncio side ----------------------------------------------------------------------------------------
    @property
    def records(self) -> list[RequestRecord]:
        """The ended requests' records held (the last ``window`` of them), in the order they ended."""
        return list(self.books.requests)

    @property
    def steps(self) -> list[dict[str, Any]]:
        """The run's step records held (the last ``window`` of them)."""
        return list(self.books.steps)

    @property
    def num_records_held(self) -> tuple[int, int]:
        """(request records, step records) held in memory now: at most ``window`` each."""
        return len(self.books.requests), len(self.books.steps)

    @property
    def limits(self) -> tuple[int, int, int]:
        """(max_model_len, num_kv_blocks, block_size): what a request must fit (fixed once the engine is built)."""
        return self.engine.max_model_len, self.engine.num_kv_blocks, self.engine.config.block_size

    def start(self) -> None:
        """Start stepping (called once, from the server's start-up)."""
        self.books.start()
        self._thread.start()

    def make_request(self, prompt: str | list[int], params: SamplingParams, **fields: Any) -> Request:
        """Tokenize and validate a request (``ValueError`` naming the field), for ``submit``. Safe beside the
        engine thread: ``EngineClient.make_request`` reads nothing a step changes."""
        return self.engine.make_request(prompt, params, **fields)

    def submit(self, request: Request, queue: asyncio.Queue, index: int = 0, stop: Sequence[str] = (),
               timeout: float | None = None) -> None:
        """Queue ``request`` (made and validated by ``engine.make_request``) for the next step; its ``Delta``s
        arrive on ``queue`` as ``(index, delta)``. With ``timeout``, it is aborted (its blocks freed) if it has
        not ended ``timeout`` seconds from now: its last delta has ``timed_out``. Raises ``QueueFull`` past
        ``max_waiting``, ``ShuttingDown`` once stopping or draining, ``DuplicateRequestId`` for an id in flight;
        nothing is queued then."""
        tracked = _Tracked(request, queue, index, IncrementalDetokenizer(self._tokenizer, stop),
                           deadline=None if timeout is None else time.monotonic() + timeout, timeout=timeout)
        with self._cond:
            if self._stopping or self._draining or self.fault is not None:
                raise ShuttingDown(self.fault or "the server is shutting down")
            if request.request_id in self._in_flight:
                raise DuplicateRequestId(f"request id {request.request_id!r} is already in flight")
            if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
                raise QueueFull(f"{self.num_waiting()} requests are waiting (server.max_waiting="
                                f"{self.max_waiting}); retry later")
            self._in_flight.add(request.request_id)
            self._inbox.submitted.append(tracked)
            self._cond.notify()

    def num_waiting(self) -> int:
        """Requests not yet scheduled: handed over and not admitted, plus the engine's waiting queue (preempted
        ones included). Exact while the lock is held: the engine thread moves requests across under it."""
        return len(self._inbox.submitted) + self.engine.queue_lengths()[1]

    def abort(self, request_id: str, reason: str) -> None:
        """End ``request_id`` before the next step (a no-op once it has ended)."""
        with self._cond:
            self._inbox.aborts.append((request_id, reason))
            self._cond.notify()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between two steps and return its result (e.g. the summary now)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if not self._thread.is_alive():
                future.set_result(fn())  # no engine thread (stopped): nothing runs beside us
            else:
                self._inbox.calls.append((fn, future))
                self._cond.notify()
        return await asyncio.wrap_future(future)

    def stop(self, timeout: float | None = None, drain: float = 0.0) -> None:
        """Take no new request; let the requests in flight run for at most ``drain`` seconds, then abort every
        one still in flight (reason ``interrupted``), deliver their final deltas and let the thread end. Blocks
        until it has; safe to call more than once."""
        with self._cond:
            self._draining = True
            if drain > 0 and self._thread.is_alive():
                self._cond.wait_for(lambda: not self._in_flight or self.fault is not None, timeout=drain)
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def stopping(self) -> bool:
        """Draining or stopped: no new request is taken (``/health`` is not ready)."""
        return self._stopping or self._draining

    def write_summary(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Compute the summary (plus ``extra``) and hand it to every logger (``metrics.json`` through the jsonl
        logger); on the engine thread (``call``) while it runs, or after ``stop``."""
        summary = {**self.summary(), **(extra or {})}
        duration = self.figures.requests.duration   # every group shares the run's, as metrics.breakdown does
        breakdowns = {by: groups.breakdown(duration) for by, groups in self.figures.groups.items()}
        for run_logger in self.loggers:
            run_logger.log_summary(summary, breakdowns)
        return summary

    def summary(self) -> dict[str, Any]:
        """The run's serving summary so far (``metrics.summarize``), as ``metrics.json`` holds it. Call it on
        the engine thread (``call``) while it runs, or after ``stop``."""
        figures = self.figures
        summary = figures.requests.summary()
        summary.update(figures.steps.summary())
        summary.update(figures.steps.spec_decode_summary())
        monitor = self.books.monitor
        if monitor is not None and figures.steps.run.num_steps:
            summary.update(figures.steps.utilisation(monitor.peak_flops, monitor.peak_bandwidth))
        summary.update(warmup_time_s=round(self.engine.warmup_time, 3), warmup_steps=self.engine.warmup_steps,
                       server=True)
        if self.fault is not None:
            summary.update(fault=self.fault)
        return summary

    # -- the engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._take_inbox():
                if self.engine.has_unfinished():
                    self._step()
        except Exception as exc:  # the engine is broken: every request still in it ends failed, with the cause
            self.fault = f"{type(exc).__name__}: {exc}"
            logger.error("engine loop stopped: %s", self.fault)
            self._fail_all(f"engine fault: {self.fault}")

    def _take_inbox(self) -> bool:
        """Wait for work, then admit submitted requests and apply aborts and calls. False: stopped and drained."""
        with self._cond:
            while not (self._inbox.submitted or self._inbox.aborts or self._inbox.calls or self._stopping
                       or self.engine.has_unfinished()):
                self._cond.wait()
            inbox, self._inbox = self._inbox, _Inbox()
            for tracked in inbox.submitted:  # under the lock, so that num_waiting() never misses one
                self._tracked[tracked.request.request_id] = tracked
                self.engine.add_request(tracked.request)
                if tracked.deadline is not None:
                    heapq.heappush(self._deadlines, (tracked.deadline, tracked.request.request_id))
            if len(self._deadlines) > 2 * len(self._tracked) + 64:
                # A request that ended before its deadline leaves its entry until the deadline passes; under a
                # long server.request_timeout those would pile up, so drop them once they outnumber the live.
                self._deadlines = [entry for entry in self._deadlines if entry[1] in self._tracked]
                heapq.heapify(self._deadlines)
        for request_id, reason in inbox.aborts:
            self.engine.abort_request(request_id, reason)
        self._expire()
        for fn, future in inbox.calls:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)
        if self._stopping:
            self.engine.abort_all(INTERRUPTED_REASON)
            if not self.engine.has_unfinished():
                return False
        return True

    def _expire(self) -> None:
        """Abort every request whose deadline has passed (its blocks are freed now; the next step reports it)."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            tracked = self._tracked.get(request_id)
            if tracked is not None and not tracked.timed_out and not tracked.stop_string_hit:
                tracked.timed_out = True
                self.engine.abort_request(request_id, f"timed out: not done within its timeout of "
                                                      f"{tracked.timeout:g} s")

    def _step(self) -> None:
        # On a cluster of real replicas, wait for the next step a little at a time, so that a request that arrives
        # meanwhile reaches its (maybe idle) replica now, not after a busy one's step (one engine never waits).
        self._final = []
        result = self.books.step(CLUSTER_POLL_S)
        if result is None:
            return
        ended = {request.request_id for request in result.finished}
        deliveries = [self._progress(t) for request_id, t in self._tracked.items() if request_id not in ended]
        self._deliver([d for d in deliveries if d is not None] + self._final)

    def _progress(self, tracked: _Tracked) -> tuple[_Tracked, Delta] | None:
        """The new tokens of a running request, as a delta; a stop string ends it before the next step."""
        request = tracked.request
        new = request.output_token_ids[tracked.num_sent:]
        if not new:
            return None
        text = tracked.detokenizer.add(new)
        if text.stopped:
            new = new[:max(0, text.num_tokens - tracked.num_sent)]
            tracked.stop_string_hit = True
            self.engine.abort_request(request.request_id, STOP_STRING_REASON)  # reported by the next step
        logprobs = request.logprobs[tracked.num_sent:tracked.num_sent + len(new)] if request.logprobs else None
        tracked.num_sent += len(new)
        if not new and not text.text:
            return None
        return tracked, Delta(list(new), text.text, logprobs, request.num_prompt_tokens, tracked.num_sent,
                                    request.num_cached_tokens)

    def _ended(self, request: Request, record: RequestRecord) -> None:
        """The books' hook for an ended request: its final delta (the tokens of its last step included), and
        its record amended when a stop string ended it."""
        tracked = self._tracked.pop(request.request_id, None)
        with self._cond:
            self._in_flight.discard(request.request_id)
            if not self._in_flight:
                self._cond.notify_all()   # a draining stop waits for this
        if tracked is None:
            return
        # After a stop string ended it in an earlier step, nothing more is output: tokens that step appended past
        # the match (accepted proposals, with speculative decoding) are dropped, as tokens sampled after it are.
        new = [] if tracked.stop_string_hit else request.output_token_ids[tracked.num_sent:]
        text = tracked.detokenizer.add(new)
        if text.stopped and not tracked.stop_string_hit:  # its very last token completed a stop string
            new, tracked.stop_string_hit = new[:max(0, text.num_tokens - tracked.num_sent)], True
        logprobs = request.logprobs[tracked.num_sent:tracked.num_sent + len(new)] if request.logprobs and new \
            else None
        tracked.num_sent += len(new)
        if tracked.stop_string_hit:
            # Ended by a stop string: finished with "stop" for the client and in the records (an engine abort
            # only because the engine does not read text); tokens sampled past the match do not count.
            kept = tracked.num_sent
            record["finish_reason"], record["error"], record["num_output_tokens"] = "stop", None, kept
            if kept:
                record["finish_time"] = record["token_times"][kept - 1]
            record["token_times"] = record["token_times"][:kept]
        timed_out = tracked.timed_out and request.status is RequestStatus.ABORTED
        failed = request.status is RequestStatus.FAILED or self._failing is not None or timed_out
        self._final.append((tracked, Delta(
            list(new), text.text + tracked.detokenizer.finish(), logprobs, request.num_prompt_tokens,
            tracked.num_sent, request.num_cached_tokens,
            finish_reason=None if failed else record["finish_reason"],
            error=(record["error"] or self._failing) if failed else None, timed_out=timed_out)))

    def _fail_all(self, reason: str) -> None:
        """After a fault: every tracked request ends (aborted, with ``reason``) and is recorded and told."""
        self._final, self._failing = [], reason
        self.books.fail_unfinished([t.request for t in list(self._tracked.values())], reason)
        deliveries = self._final
        with self._cond:
            self._in_flight.clear()
            self._stopping = True
        self._deliver(deliveries)

    def _deliver(self, deliveries: list[tuple[_Tracked, Delta]]) -> None:
        """Hand one step's deltas to the event loop in one callback (a closed loop: nobody is listening)."""
        if not deliveries:
            return
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(_put_all, deliveries)


def _put_all(deliveries: list[tuple[_Tracked, Delta]]) -> None:
    for tracked, delta in deliveries:
        tracked.queue.put_nowait((tracked.index, delta))


__all__ = ["EngineLoop", "Delta", "QueueFull", "ShuttingDown", "DuplicateRequestId", "StepError",
           "STOP_STRING_REASON", "INTERRUPTED_REASON"]
