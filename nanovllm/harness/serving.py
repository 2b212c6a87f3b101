"""The online serving loop: each request enters the engine when its arrival time comes, as it would from a
client, and the run comes out as plain records plus their summary. ``python -m nanovllm.run`` drives it; from
Python::

    engine = LLM(scheduler="priority").engine
    result = serve(engine, generate_workload(ChatWorkloadConfig(num_requests=8), engine.tokenizer))
    print(format_summary(result.summary))
    print(format_breakdown(result.by_priority, "priority"))

The clock is the wall clock: a workload's ``arrival_time`` is seconds after ``serve`` starts, and a request
that arrives while a step runs joins before the next step (steps are atomic, as in any engine). Its recorded
arrival is the workload's time, not the moment the loop noticed it, so queueing behind a long step counts in
its latency, as a client would see it. The simulator (``nanovllm.harness.sim``) runs this same loop on a
virtual clock (``serve(..., clock=...)``): arrivals at workload times, each step as long as its model says.

``ServedEngine`` carries what serving an engine needs besides the workload (its clock, its cost model for the
monitor, what ``metrics.json`` says about where it ran); ``python -m nanovllm.run`` serves every runner through
one (the simulator's is a ``Simulation``).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence, overload

from nanovllm.config import EngineConfig
from nanovllm.engine.engine import LLMEngine, PluginSpec
from nanovllm.engine.protocol import EngineClient
from nanovllm.harness.workload import WorkloadRequest
from nanovllm.progress import RequestProgress
from nanovllm.request import Request, RequestStatus
from nanovllm.sampling import SamplingParams
from nanovllm.serving.formatting import format_value
from nanovllm.serving.loggers import RunLogger
from nanovllm.serving.loop import StepLoop
from nanovllm.serving.metrics import SLO, summarize_with_breakdowns
from nanovllm.serving.monitor import ModelCost, Monitor, MonitorConfig
from nanovllm.serving.records import RequestRecord
from nanovllm.serving.step_records import StepRecords, StepTotals


@dataclass
class RunResult:
    """What one ``serve`` produced. Times in records are seconds since the run started."""

    requests: list[RequestRecord]                 # every request, finished or failed, in the order they ended
    steps: list[dict[str, Any]]                   # StepRecords, with flops/bytes/mfu/mbu when monitored
    summary: dict[str, Any]                       # metrics.summarize (+ run-level mfu/mbu when monitored)
    breakdowns: dict[str, dict[str, dict[str, Any]]]  # {"priority": {class: summary}, "client_id": {...}}
    output_token_ids: dict[str, list[int]]        # request_id -> generated tokens (finished requests)
    wall_time: float                              # seconds from serve() start to its end

    @property
    def by_priority(self) -> dict[str, dict[str, Any]]:
        return self.breakdowns["priority"]

    @property
    def by_client(self) -> dict[str, dict[str, Any]]:
        return self.breakdowns["client_id"]


class ServingClock(Protocol):
    """The loop's time: ``now()`` and ``wait_until(t)`` (idle until ``t``)."""

    def now(self) -> float: ...

    def wait_until(self, t: float, stop: threading.Event | None = None) -> None: ...


class WallClock:
    """Real time: ``perf_counter``; idling sleeps rather than spins (a spinning loop would steal a CPU core
    from the model on small machines and distort the very timings being measured)."""

    def now(self) -> float:
        return time.perf_counter()

    def wait_until(self, t: float, stop: threading.Event | None = None) -> None:
        idle = max(0.0, t - time.perf_counter())
        if stop is not None:
            stop.wait(idle)  # a stop request wakes it at once
        else:
            time.sleep(idle)


@dataclass
class ServedEngine:
    """An engine ready to ``serve``: the clock its steps run on and its cost model (the FLOPs and bytes the
    monitor counts). ``build`` makes one for a runner that keeps real time (``real``, ``tp``); the simulator's
    ``Simulation`` is one whose clock is virtual."""

    engine: EngineClient
    clock: ServingClock
    cost: ModelCost

    @classmethod
    def build(cls, config: EngineConfig, runner: PluginSpec = "real", **plugins: PluginSpec) -> "ServedEngine":
        """The engine on ``runner`` (a registered name or ``{"name": ..., **options}``) and the wall clock; the
        cost model is the loaded model's (what runs is what is counted), else its HF config's."""
        engine = LLMEngine(config, runner=runner, **plugins)
        model = engine.runner.model
        cost = ModelCost.from_model(model, config.kv_cache_dtype) if model is not None else \
            ModelCost.from_hf_config(engine.hf_config, engine.runner.dtype, config.kv_cache_dtype,
                                     config.quantization, config.model)
        return cls(engine, WallClock(), cost)

    @property
    def annotations(self) -> dict[str, Any]:
        """What ``metrics.json`` gains: the machine the run ran on (CPU model, architecture, ISA level, torch
        threads), which a step-time profile fitted on the run records (``nanovllm.harness.sim.calibrate``)."""
        # Imported here: nanovllm.harness.sim's package imports the simulator, which serves through this module.
        from nanovllm.harness.sim.this_machine import this_machine

        return {"machine": this_machine()}

    def monitor_config(self, configured: MonitorConfig) -> MonitorConfig:
        """The MFU/MBU peaks to divide by: the configured ones (measured on this machine when left null)."""
        return configured

    def serve(self, workload: Sequence[WorkloadRequest], **kwargs: Any) -> "RunResult":
        """``serve`` this engine on its clock, its ``annotations`` in the summary; ``kwargs`` as ``serve``'s."""
        return serve(self.engine, workload, clock=self.clock, annotations=self.annotations,
                     summary_extras=self.summary_extras, breakdown_by=self.breakdown_by, **kwargs)

    #: The request-record fields the run is broken down by (``RunResult.breakdowns``).
    breakdown_by: ClassVar[tuple[str, ...]] = ("priority", "client_id")

    def summary_extras(self, records: Sequence[RequestRecord], steps: Sequence[dict[str, Any]],
                       totals: StepTotals | None = None) -> dict[str, Any]:
        """What the summary gains from the finished run's records beyond ``summarize`` (a cluster adds its
        per-replica figures); called once, after the last request ended, before the loggers get the summary.
        ``totals``: the step figures over every step when ``steps`` holds fewer (``records.steps``)."""
        return {}

    def close(self) -> None:
        """Release what serving held, once the run or server is over (nothing for one engine in this process;
        a cluster stops its Ray actors)."""


def serve(
    engine: EngineClient,
    workload: Sequence[WorkloadRequest],
    *,
    progress: bool = True,
    loggers: Sequence[RunLogger] = (),
    monitor: Monitor | None = None,
    slo: SLO | None = None,
    temperature: float = 0.0,
    clock: ServingClock | None = None,
    annotations: Mapping[str, Any] | None = None,
    stop: threading.Event | None = None,
    summary_extras: Callable[..., Mapping[str, Any]] | None = None,
    breakdown_by: Sequence[str] = ("priority", "client_id"),
    step_records: StepRecords = StepRecords(),
) -> RunResult:
    """Serve ``workload`` on ``engine`` in real time and return the run's records and summary.

    A request the engine rejects (prompt too long, ...) is recorded as failed with the reason in ``error``
    and the others go on. ``loggers`` get every step and request as it happens and the summary at the end
    (their ``start``/``finish`` are the caller's: it knows the run directory). The run's steps are numbered
    from 0 and timed from ``serve``'s start, whatever the engine did before. ``clock``: the wall clock by
    default; the simulator passes its virtual one (the engine must read the same clock). ``annotations`` are
    added to the summary (the simulator marks its runs ``simulated``), and so is what ``summary_extras(records,
    steps)`` returns after the run; ``breakdown_by`` names the record fields of ``RunResult.breakdowns``.
    ``engine`` may be a ``nanovllm.cluster.Cluster`` (replicas behind a router), driven the same way. The engine's warm-up (done when it was
    built, before ``serve``'s clock starts) is reported as ``warmup_time_s`` / ``warmup_steps``, never in a request.

    ``step_records`` bounds the step records kept and logged (``records.steps``: every one by default); the
    summary's step figures are over every step whichever are kept (``nanovllm.serving.step_records``).

    When ``stop`` is set (``python -m nanovllm.run`` sets it on SIGINT/SIGTERM) the loop ends after the current
    step: every unfinished request is aborted with reason ``interrupted`` and recorded, requests that had not
    arrived yet are only counted, and the summary says ``"interrupted": true`` over what there is.
    """
    clock = clock or WallClock()
    run = _Run(engine, StepLoop(engine, loggers=loggers, monitor=monitor, step_records=step_records,
                                progress=RequestProgress(len(workload), disable=not progress)), temperature, clock)
    try:
        run.loop(workload, stop)
    except Exception as exc:
        with contextlib.suppress(Exception):  # every request written if possible, then the original error
            run.books.fail_unfinished(run.submitted, f"engine fault: {type(exc).__name__}")
            run.books.flush_steps()
        raise
    finally:
        if run.books.progress is not None:
            run.books.progress.close()
    run.books.flush_steps()
    run.check_all_ended(len(run.submitted) if run.interrupted else len(workload))

    records, steps, totals = run.books.requests, run.books.steps, run.books.totals
    summary, breakdowns = summarize_with_breakdowns(records, steps, breakdown_by, slo=slo)
    if totals is not None:   # fewer records kept than steps run: the step figures come from every step
        summary.update(totals.summary())
    if run.interrupted:
        summary.update(interrupted=True, not_arrived=len(workload) - len(run.submitted))
    if monitor is not None:
        overall = monitor.overall(steps) if totals is None else \
            totals.utilisation(monitor.peak_flops, monitor.peak_bandwidth)
        summary.update(mfu=overall["mfu"], mbu=overall["mbu"])
    summary.update(warmup_time_s=round(engine.warmup_time, 3), warmup_steps=engine.warmup_steps)
    summary.update(annotations or {})
    if summary_extras is not None:
        summary.update(summary_extras(records, steps, totals) if totals is not None else
                       summary_extras(records, steps))
    for logger in loggers:
        logger.log_summary(summary, breakdowns)
    return RunResult(
        requests=records, steps=steps, summary=summary, breakdowns=breakdowns,
        output_token_ids={r.request_id: r.output_token_ids for r in run.submitted
                          if r.status is RequestStatus.FINISHED},
        wall_time=clock.now() - run.books.t0,
    )


class _ArrivalTimes(Sequence[float]):
    """The arrival times (on the run's clock) of the requests still to come, read from the run's queue of them
    when asked (``EngineClient.set_horizon``'s ``upcoming``)."""

    def __init__(self, pending: deque[tuple[int, WorkloadRequest]], t0: float) -> None:
        self._pending, self._t0 = pending, t0

    def __len__(self) -> int:
        return len(self._pending)

    @overload
    def __getitem__(self, index: int) -> float: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[float]: ...

    def __getitem__(self, index: int | slice) -> float | Sequence[float]:
        if isinstance(index, slice):
            return [self._t0 + w.arrival_time for _, w in list(self._pending)[index]]
        return self._t0 + self._pending[index][1].arrival_time


class _Run:
    """The state of one ``serve`` call: what was submitted and when; its books are its ``StepLoop``'s."""

    def __init__(self, engine: EngineClient, books: StepLoop, temperature: float, clock: ServingClock) -> None:
        self.engine = engine
        self.books = books
        self.clock = clock
        self.temperature = temperature
        self.submitted: list[Request] = []
        self.interrupted = False

    def loop(self, workload: Sequence[WorkloadRequest], stop: threading.Event | None = None) -> None:
        engine = self.engine
        # Keep each request's index in the caller's list: it is the id of requests that bring none.
        pending = deque(sorted(enumerate(workload), key=lambda item: item[1].arrival_time))
        self.books.start()
        t0 = self.books.t0
        while pending or engine.has_unfinished():
            if stop is not None and stop.is_set():
                self.interrupted = True
                self.books.abort_all("interrupted")
                return
            # The clock is read again after each arrival: on a cluster, a request given to an idle replica
            # starts that replica's clock at its arrival, which may be the next step to run.
            while pending and t0 + pending[0][1].arrival_time <= self.clock.now():
                self._submit(*pending.popleft())
            if engine.has_unfinished():
                # Real replicas step on their own (RayCluster): wait for the next step only until the next
                # arrival, which is routed then, at its time, to a replica that may be idle (None: it came first).
                next_arrival = t0 + pending[0][1].arrival_time if pending else None
                # A simulated engine may compute the steps before it at once (decode stretches).
                engine.set_horizon(math.inf if next_arrival is None else next_arrival, _ArrivalTimes(pending, t0))
                if not self.books.step_ahead():
                    self.books.step(None if next_arrival is None else max(0.0, next_arrival - self.clock.now()))
            elif pending:
                self.clock.wait_until(t0 + pending[0][1].arrival_time, stop)

    def _submit(self, index: int, w: WorkloadRequest) -> None:
        request_id = w.request_id if w.request_id is not None else str(index)
        params = SamplingParams(temperature=self.temperature, max_tokens=w.max_tokens, ignore_eos=w.ignore_eos)
        fields: dict[str, Any] = dict(arrival_time=self.books.t0 + w.arrival_time, priority=w.priority, client_id=w.client_id,
                      request_id=request_id,
                      slo_ttft=None if w.ttft_slo_ms is None else w.ttft_slo_ms / 1000.0,
                      slo_e2el=None if w.e2el_slo_ms is None else w.e2el_slo_ms / 1000.0,
                      session_id=w.session_id)
        try:
            request, error = self.engine.make_request(w.prompt, params, **fields), None
        except ValueError as exc:
            # The engine refuses it: it ends failed with the reason, through the same step() as every other.
            request, error = self.engine.rejected_request(w.prompt, params, **fields), str(exc)
        self.engine.add_request(request, error=error)
        self.submitted.append(request)

    def check_all_ended(self, total: int) -> None:
        """Every request must end finished or failed; anything else is an engine bug, not a slow run."""
        stuck = [r.request_id for r in self.submitted if not r.is_finished]
        recorded = len(self.books.requests)
        if stuck or recorded != total:
            raise RuntimeError(f"serve ended with {recorded} of {total} requests recorded; "
                               f"unfinished: {', '.join(stuck) or 'none'}")


# -- console ------------------------------------------------------------------------------------------------------

_BREAKDOWN_COLUMNS = [
    ("requests", None), ("done", "completed"), ("failed", "failed"),
    ("mean TTFT ms", "mean_ttft_ms"), ("p99 TTFT ms", "p99_ttft_ms"), ("mean TPOT ms", "mean_tpot_ms"),
    ("mean E2EL ms", "mean_e2el_ms"), ("mean queue ms", "mean_queue_time_ms"), ("preempt", "num_preemptions"),
]


def format_breakdown(groups: dict[str, dict[str, Any]], by: str) -> str:
    """A small console table, one row per group of a ``RunResult.breakdowns`` entry (e.g. per priority)."""

    def cell(summary: dict[str, Any], key: str | None) -> str:
        if key is None:
            return str(summary["completed"] + summary["failed"] + summary.get("aborted", 0) + summary["unfinished"])
        return format_value(summary.get(key), ".1f")

    header = [by] + [label for label, _ in _BREAKDOWN_COLUMNS]
    rows = [[group] + [cell(s, key) for _, key in _BREAKDOWN_COLUMNS] for group, s in groups.items()]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(text.rjust(w) for text, w in zip(row, widths)) for row in [header, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])
