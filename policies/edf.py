"""Earliest deadline first from per-request SLOs (Liu & Layland 1973; applied to LLM serving with per-request
latency targets in e.g. Andes, Liu et al. 2024, and SLOs-Serve, Chen et al. 2025).

Each request carries its own targets (``Request.slo_ttft`` / ``slo_e2el`` in seconds, from the workload's
``ttft_slo_ms`` / ``e2el_slo_ms``). ``deadline="ttft"`` orders waiting requests by ``arrival + slo_ttft``;
``deadline="e2el"`` by ``arrival + slo_e2el``. Running requests keep arrival order among themselves.

Admission control (``admission_control=true``): a waiting request that can no longer meet its deadline is
rejected with the reason, instead of taking seats from requests that still can (past saturation, serving a
hopeless request makes others late too). "Can no longer" means the deadline has passed, or (with a
``step_time`` estimate in seconds) fewer steps remain before it than the request needs at least: one for a
first token, one per output token for an end-to-end deadline. The scheduler asks about a request only once
that time could have come (``reject_after``), not at every step.

A request without the target ``deadline`` names gets ``default_slo_ms``; without that either, with
``require_slo=true`` (as ``conf/scheduler/edf.yaml`` sets, so a workload without SLOs is caught) the run stops
with an error naming the missing field, and with ``require_slo=false`` (the Python default) it has no deadline
and is served after every request that has one, first come first served."""

from __future__ import annotations

import math

from nanovllm import Policy, Request, RequestStatus, a_hair_before, register_policy

DEADLINES = ("ttft", "e2el")


@register_policy("edf")
class EarliestDeadlineFirst(Policy):
    waiting_key = "static"   # a waiting request's deadline is fixed (running ones keep arrival order)

    def __init__(self, deadline: str = "ttft", admission_control: bool = True, step_time: float = 0.0,
                 default_slo_ms: float | None = None, require_slo: bool = False) -> None:
        if deadline not in DEADLINES:
            raise ValueError(f"scheduler.deadline must be one of {', '.join(DEADLINES)}, got {deadline!r}")
        if not isinstance(step_time, (int, float)) or step_time < 0:
            raise ValueError(f"scheduler.step_time must be a number of seconds >= 0, got {step_time!r}")
        if default_slo_ms is not None and not default_slo_ms > 0:
            raise ValueError(f"scheduler.default_slo_ms must be > 0 or null, got {default_slo_ms!r}")
        self.deadline = deadline
        self.admission_control = admission_control
        self.step_time = step_time
        self.default_slo_ms = default_slo_ms
        self.require_slo = require_slo

    def slo_of(self, request: Request) -> float:
        """The request's target in seconds for the chosen ``deadline`` (inf if it has none and none is
        required); ValueError naming the field if it has none and ``require_slo`` is set."""
        slo = request.slo_ttft if self.deadline == "ttft" else request.slo_e2el
        if slo is not None:
            return slo
        if self.default_slo_ms is not None:
            return self.default_slo_ms / 1000.0
        if not self.require_slo:
            return math.inf
        field = f"{self.deadline}_slo_ms"
        raise ValueError(f"scheduler=edf with deadline={self.deadline!r} needs every request's {field}: request "
                         f"{request.request_id!r} has none; set workload.{field} (one target per priority "
                         f"class), scheduler.default_slo_ms, or scheduler.deadline to one of {', '.join(DEADLINES)}")

    def deadline_of(self, request: Request) -> float:
        return request.arrival_time + self.slo_of(request)

    def on_arrival(self, request: Request, now: float) -> None:
        self.slo_of(request)   # with require_slo, a request without its target fails the run at once

    def priority(self, request: Request, now: float):
        if request.status is RequestStatus.RUNNING:
            return (request.arrival_time,)
        return (self.deadline_of(request), request.arrival_time)

    def _steps_needed(self, request: Request) -> int:
        """The fewest steps ``request`` needs before its deadline: one for a first token, one per output token."""
        return 1 if self.deadline == "ttft" else max(1, request.max_tokens)

    def reject_reason(self, request: Request, now: float) -> str | None:
        if not self.admission_control or request.status is not RequestStatus.WAITING:
            return None   # a preempted request already produced tokens: finish it rather than waste them
        if now + self.step_time * self._steps_needed(request) > self.deadline_of(request):
            return (f"cannot meet its {self.deadline} deadline ({self.slo_of(request) * 1000:.0f} ms after "
                    f"arrival)")
        return None

    def reject_after(self, request: Request, now: float) -> float | None:
        """``reject_reason``'s rule solved for ``now``: the last moment the request can still start in time."""
        if not self.admission_control or request.status is not RequestStatus.WAITING:
            return None
        deadline, needed = self.deadline_of(request), self.step_time * self._steps_needed(request)
        return None if math.isinf(deadline) else a_hair_before(deadline - needed, deadline, needed)
