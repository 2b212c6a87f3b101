"""``StepLoop``: the one place where ``step()`` results become a run's records.

Every driver runs requests through an ``EngineClient`` (``nanovllm.engine.protocol``) the same way: add them,
step while any is unfinished, and after each step turn the step's record into the run's (numbered from 0, times
relative to the run's start), annotate it with MFU/MBU when a monitor is given, write it and every request that
ended through the loggers, and move the progress bar. ``LLM.generate``, the Hydra serving loop
(``nanovllm.harness.serving.serve``) and the HTTP server's engine thread (``nanovllm.server.engine_loop``) differ
only in when requests arrive and what else they do between steps; the books are kept here, once, so the same
requests give the same records whichever drives them.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from nanovllm.engine.protocol import EngineClient, StepOutput
from nanovllm.outputs import StepColumns, StepRecord
from nanovllm.progress import RequestProgress
from nanovllm.request import Request
from nanovllm.serving.loggers import RunLogger
from nanovllm.serving.monitor import Monitor
from nanovllm.serving.records import RequestRecord, request_record, step_record
from nanovllm.serving.step_records import StepKeeper, StepRecords, StepTotals

#: Called with each ended request and its record before the record is kept and logged; it may amend the record
#: (the HTTP server ends a request at a stop string, which the engine reports as an abort).
RecordHook = Callable[[Request, RequestRecord], None]

#: Steps a loop holds before it keeps those settled, where a client reports steps out of order
#: (``EngineClient.steps_settled_before``): enough that their records are kept with array operations, few
#: enough that a long run holds a bounded number.
SETTLE_EVERY = 16_384
#: ... and at least this often (wall seconds), so that a live view of the run sees its steps as it goes.
SETTLE_WALL_S = 0.5


class StepLoop:
    """One run on ``client``: its step and request records, kept and logged as they happen.

    ``loggers`` get every step and ended request (their ``start`` / ``finish`` are the caller's, who knows the
    run directory); ``monitor`` annotates each step with its FLOPs, bytes, MFU and MBU; ``progress`` is moved
    after every step; ``on_ended`` may amend an ended request's record before it is kept (``RecordHook``).
    ``step_records`` says which step records are kept and logged (``StepRecords``: every one by default);
    when fewer, ``totals`` holds the summary's step figures over all of them. ``window``: hold only the last
    ``window`` request and step records in ``requests`` and ``steps`` (a rolling window, for a server that runs
    for days; the loggers still get every one, so the run's files hold them all); None: hold every one. The
    run's clock starts when the loop is made, or at ``start()``.
    """

    def __init__(self, client: EngineClient, *, loggers: Sequence[RunLogger] = (), monitor: Monitor | None = None,
                 progress: RequestProgress | None = None, on_ended: RecordHook | None = None,
                 step_records: StepRecords = StepRecords(), window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"a record window holds at least one record, got {window}")
        self.client = client
        self.loggers = list(loggers)
        self.monitor = monitor
        self.progress = progress
        self.on_ended = on_ended
        # every ended request in the order they ended, and the step records kept (annotated when monitored); or
        # only the last ``window`` of each. Plain lists either way (LLM reads them as they fill): dropping the
        # oldest of a window of a few thousand is one short memmove, nothing next to a step.
        self.window = window
        self.requests: list[RequestRecord] = []
        self.steps: list[dict[str, Any]] = []
        self.num_ended = 0                        # requests ended so far (all of them, whichever are held)
        self.keeper = StepKeeper(step_records)
        self.output_tokens = 0
        self.t0 = client.clock()
        # Steps reported out of order (``EngineClient.steps_settled_before``): held, as their records' columns
        # and as single records, until they are settled; then kept in order.
        self._deferring = False
        self._unsettled: list[StepColumns] = []
        self._unsettled_records: list[StepRecord] = []
        self._num_unsettled = 0
        # The requests that ended in held steps, each under its step's (start, replica, own step number) and its
        # place among the step's ended ones: kept in that order as their steps settle.
        self._unsettled_ended: list[tuple[float, int, int, int, Request]] = []
        self._settle_at = SETTLE_EVERY
        self._settle_by = time.monotonic() + SETTLE_WALL_S

    def start(self) -> None:
        """Start the run's clock now (a server starts it when it starts serving, not when it was built)."""
        self.t0 = self.client.clock()

    def step(self, timeout: float | None = None) -> StepOutput | None:
        """Run the client's next step and keep its books; None when ``timeout`` seconds passed with no step
        ready (only a client whose replicas step on their own ever waits: ``EngineClient.wait_for_step``).
        Called while ``client.has_unfinished()``."""
        if not self.client.wait_for_step(timeout):
            return None
        output = self.client.step()
        self.keep_step(output)
        if self._deferring:
            record = output.record
            for place, request in enumerate(output.finished):
                self._unsettled_ended.append((record["start_time"], record.get("replica", 0), record["step"], place,
                                              request))
        else:
            self._end(output.finished)
        return output

    def _end(self, requests: Sequence[Request]) -> None:
        """Keep and log the records of ``requests``, which ended in this order."""
        for request in requests:
            self.output_tokens += request.num_output_tokens
            self.ended(request, request_record(request, self.t0))
        if self.progress is not None and requests:   # (it shows requests ended and their tokens)
            self.progress.update(self.num_ended, self.output_tokens)

    @property
    def num_steps(self) -> int:
        """Steps run so far (all of them, whichever records are kept)."""
        return self.keeper.num_steps

    @property
    def totals(self) -> StepTotals | None:
        """The summary's step figures over every step when fewer records are kept; None when all are."""
        return self.keeper.totals

    def keep_step(self, output: StepOutput) -> None:
        """Number, annotate, keep and log one step's record (``step`` calls it after each step), or hold it
        until it is settled where the client reports steps out of order."""
        if self._defers():
            self._unsettled_records.append(output.record)
            self._hold(1)
            return
        self._keep_record(output.record)

    def _keep_record(self, record: StepRecord) -> None:
        step = step_record(record, self.t0, self.keeper.num_steps)
        annotated = self.monitor.annotate(step) if self.monitor is not None else dict(step)
        self._keep(self.keeper.offer(annotated))

    def step_ahead(self) -> bool:
        """Keep the books of the steps the client computed ahead, all at once, if the next steps are such
        (``EngineClient.take_steps_ahead``: decode stretches, where no request starts, and the requests that
        ended in them); False when the next step is not one (``step`` runs it). For a driver that set a horizon;
        the books are those ``step`` would keep one step at a time."""
        ahead = self.client.take_steps_ahead()
        if ahead is None:
            return False
        if self._defers():
            if ahead.ended:   # each under its step's keys, found in the part that holds it
                offsets = np.cumsum([0] + [len(part) for part in ahead.parts]).tolist()
                for place, (position, request) in enumerate(ahead.ended):
                    part_index = bisect.bisect_right(offsets, position) - 1
                    part, row = ahead.parts[part_index], position - offsets[part_index]
                    replica = int(part.at("replica", row)) if "replica" in part.keys else 0
                    self._unsettled_ended.append((float(part.at("start_time", row)), replica,
                                                  int(part.at("step", row)), place, request))
            self._unsettled.extend(ahead.parts)
            self._hold(len(ahead))
        else:
            self._keep_columns(ahead.steps)
            self._end([request for _, request in ahead.ended])
        return True

    def flush_steps(self) -> None:
        """Keep and log the steps still held unsettled and the step aggregates still open
        (``records.steps=interval:...``); once, after the run (no step comes after it)."""
        self._settle(math.inf)
        self._keep(self.keeper.flush())

    def _keep_columns(self, ahead: StepColumns) -> None:
        """Number, annotate, keep and log the records of ``ahead``, in their order. A step that took no time
        (one that only reported refused requests) has no MFU or MBU, which would keep the steps around it one
        by one: it is kept on its own, the runs between in bulk."""
        idle = np.flatnonzero(ahead.value("duration") <= 0)
        if len(idle) and len(ahead) > 1:
            bounds = sorted({0, len(ahead), *idle.tolist(), *(idle + 1).tolist()})
            for start, stop in zip(bounds, bounds[1:]):
                self._keep_run(ahead.take(start, stop))
            return
        self._keep_run(ahead)

    def _keep_run(self, ahead: StepColumns) -> None:
        first = self.keeper.num_steps
        steps = ahead.with_column("step", np.arange(first, first + len(ahead))) \
            .with_column("start_time", ahead.value("start_time") - self.t0)
        if self.monitor is not None:
            steps = self.monitor.annotate_columns(steps)
        self._keep(self.keeper.offer_columns(steps))

    def _defers(self) -> bool:
        """Whether the client reports steps out of order (once it has, the loop holds its steps to the end)."""
        if not self._deferring and self.client.steps_settled_before() is not None:
            self._deferring = True
        return self._deferring

    def _hold(self, count: int) -> None:
        """``count`` more steps are held: once enough are, keep those that are settled."""
        self._num_unsettled += count
        if self._num_unsettled >= self._settle_at or time.monotonic() >= self._settle_by:
            settled = self.client.steps_settled_before()
            self._settle(math.inf if settled is None else settled)
            # What stays held is sorted again at the next settling: wait for as many new steps first.
            self._settle_at = self._num_unsettled + SETTLE_EVERY
            self._settle_by = time.monotonic() + SETTLE_WALL_S

    def _settle(self, before: float) -> None:
        """Keep, in order (start time, replica, the replica's own step number), the held steps that start
        before ``before``, and the requests that ended in them; hold the rest."""
        self._settle_ended(before)
        fields = self._unsettled[0].keys if self._unsettled else \
            list(self._unsettled_records[0]) if self._unsettled_records else []
        if any(part.keys != fields for part in self._unsettled) or \
                any(list(record) != fields for record in self._unsettled_records):
            self._settle_one_by_one(before)   # records of different fields (replicas configured apart)
            return
        parts = self._unsettled + ([StepColumns.of_records(self._unsettled_records)] if self._unsettled_records else [])
        self._unsettled, self._unsettled_records, self._num_unsettled = [], [], 0
        if not parts:
            return
        steps = StepColumns.concatenate(parts)
        start = steps.value("start_time")
        replica = steps.value("replica") if "replica" in steps.keys else np.zeros(len(steps), dtype=np.int64)
        order = np.lexsort((steps.value("step"), replica, start))
        settled = int(np.searchsorted(start[order], before, side="left"))
        if settled:
            self._keep_columns(steps.select(order[:settled]))
        if settled < len(order):
            self._unsettled = [steps.select(order[settled:])]
            self._num_unsettled = len(order) - settled

    def _settle_ended(self, before: float) -> None:
        """Keep the records of the held requests whose steps start before ``before``, in their steps' order."""
        if not self._unsettled_ended:
            return
        # (Entries differ in their first four fields, so the request itself is never compared.)
        self._unsettled_ended.sort()
        settled = bisect.bisect_left(self._unsettled_ended, (before,))
        done, self._unsettled_ended = self._unsettled_ended[:settled], self._unsettled_ended[settled:]
        self._end([entry[4] for entry in done])

    def _settle_one_by_one(self, before: float) -> None:
        """``_settle`` for held steps whose records have different fields (a replica with KV tiers beside one
        without): each record on its own, in the same order."""
        held = [record for part in self._unsettled for record in part.records()] + self._unsettled_records
        held.sort(key=lambda record: (record["start_time"], record.get("replica", 0), record["step"]))
        self._unsettled, self._unsettled_records = [], []
        for record in held:
            if record["start_time"] < before:
                self._keep_record(record)
            else:
                self._unsettled_records.append(record)
        self._num_unsettled = len(self._unsettled_records)

    def _keep(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self.steps.append(record)
            if self.window is not None and len(self.steps) > self.window:
                del self.steps[0]
            for logger in self.loggers:
                logger.log_step(record)

    def ended(self, request: Request, record: RequestRecord) -> None:
        """Keep and log the record of a request that ended (``step`` calls it for each one a step reports)."""
        if self.on_ended is not None:
            self.on_ended(request, record)
        self.num_ended += 1
        self.requests.append(record)
        if self.window is not None and len(self.requests) > self.window:
            del self.requests[0]
        for logger in self.loggers:
            logger.log_request(record)

    def abort_all(self, reason: str) -> list[str]:
        """Abort every unfinished request and step until the client has reported them all (with no model run),
        each recorded with ``reason``; returns their ids. For an interrupted run, and a server that stops."""
        ids = self.client.abort_all(reason)
        while self.client.has_unfinished():
            self.step()
        return ids

    def fail_unfinished(self, requests: Iterable[Request], reason: str) -> list[tuple[Request, RequestRecord]]:
        """After a fault (the client may be broken): abort what it still holds, best effort, and record each of
        ``requests`` not yet recorded as aborted with ``reason``, so the run's files account for every request.
        Returns what it recorded."""
        self._settle_ended(math.inf)   # requests that ended in held steps are recorded, not failed again
        with contextlib.suppress(Exception):
            self.client.abort_all(reason)
        with contextlib.suppress(Exception):
            if self.client.has_unfinished():
                self.client.step()   # reports the aborted requests and leaves the client empty, if it still can
        recorded = {r["request_id"] for r in self.requests}
        failed = []
        for request in requests:
            if request.request_id in recorded:
                continue
            record = request_record(request, self.t0)
            if record["error"] is None and not request.is_finished:
                record["finish_reason"], record["error"] = "abort", reason
            with contextlib.suppress(Exception):   # one broken logger must not keep the others from the record
                self.ended(request, record)
            failed.append((request, record))
        return failed
