"""One replica of a cluster as the cluster keeps it: its engine, and the running figures a router reads in a
``ReplicaView`` (kept up to date step by step, so building a view costs the same with 10 or 100,000 requests
queued)."""

from __future__ import annotations

import bisect
import copy
import math
from collections import deque
from typing import Any, Sequence, overload

import numpy as np

from nanovllm.engine.engine import LLMEngine
from nanovllm.engine.protocol import StepOutput, StepsAhead
from nanovllm.request import Request, RequestStatus
from nanovllm.router import ReplicaView

RECENT_REQUESTS = 16   # the finished requests whose TTFT and inter-token latency a view reports (their mean)


class LocalReplica:
    """A replica whose engine runs in this process (a simulated engine, or a real one).

    The cluster calls ``add`` when the router sent it a request, ``step`` to run one engine step, ``view`` when
    a request is being routed. ``num_queued_tokens`` is the sum over its unfinished requests of the tokens not
    computed yet; it is updated from each step's plan (the scheduled, preempted and ended requests are the only
    ones whose count can change in a step), never by scanning the queues."""

    def __init__(self, index: int, engine: LLMEngine, view_index: int | None = None) -> None:
        self.index = index
        self.view_index = index if view_index is None else view_index   # its position among the views it is in
        self.engine = engine
        self.alive = True
        self.num_routed = 0
        self.num_queued_tokens = 0
        self.num_decoding = 0          # running requests past their prompt, as of the last step
        self.recent_ttft: float | None = None
        self.recent_itl: float | None = None
        self._queued: dict[Request, int] = {}   # unfinished request -> its tokens not computed yet
        self._view: ReplicaView | None = None   # reused until the replica changes (a step, a new request)
        # What a real router would see while this replica's step is in progress: its state as of its last step
        # (the view at this step's start) and the requests routed to it since (``view``).
        self._reported: ReplicaView | None = None
        self._since: list[Request] = []
        # While a decode stretch runs ahead: the end times of its steps where requests ended before its last
        # step (one entry a request, sorted), which the reported view (as of the last step) no longer counts.
        self._ended_ahead: list[float] = []
        self._recent: deque[tuple[float, float | None]] = deque(maxlen=RECENT_REQUESTS)  # (TTFT, ITL) seconds
        self.num_incoming = 0   # handed-off requests routed here whose K/V are still on the way (disaggregation)
        # Faults (a simulated cluster's ``cluster.faults``): a hung replica holds its requests and never steps;
        # restarts count the engines built anew for it after a death.
        self.hung = False
        self.num_restarts = 0

    # -- what the cluster does to it -----------------------------------------------------------------------------
    def add(self, request: Request, error: str | None = None) -> None:
        """Queue ``request`` on this replica's engine (``error``: it was refused and ends failed)."""
        self.num_routed += 1
        self._view = None
        self.engine.add_request(request, error=error)
        if error is None:
            self._track(request)
            if self._reported is not None:
                self._since.append(request)

    def expect(self) -> None:
        """A decode router chose this replica for a handed-off request whose K/V are on the way: its views
        count it as waiting from now on."""
        self.num_incoming += 1
        self._view = None

    def add_handed_off(self, request: Request) -> None:
        """The K/V of a request this replica was chosen for arrived: it joins the engine's waiting queue."""
        self.num_incoming = max(0, self.num_incoming - 1)   # (a Ray actor's copy is never told to expect)
        self.num_routed += 1
        self._view = None
        self.engine.add_handed_off(request)
        self._track(request)
        if self._reported is not None:
            self._since.append(request)

    def wake(self, t: float) -> None:
        """An idle replica is given a request that arrived at ``t``: a virtual clock jumps there (a wall clock
        is already there)."""
        wait_until = getattr(self.engine.runner.clock, "wait_until", None)
        if wait_until is not None:
            wait_until(t)

    def steps_ahead_starts(self) -> np.ndarray | None:
        """When the engine's steps computed ahead start (``LLMEngine.steps_ahead_starts``). A stretch starting
        now is reported as ``step`` reports its last step (the view as of that step's start, for a router that
        asks while it runs): a request can reach this replica only during that step (the stretch ends at its
        horizon). The requests that end in the stretch leave the figures now (``_ended``), those of its last
        step after the view is taken; its free blocks are those the stretch's records show before its last
        step. While the earlier steps run a router reads no more than the count of requests outstanding
        (``num_outstanding``), which counts those ending later in the stretch."""
        if self.engine.has_stretch():
            return self.engine.steps_ahead_starts()
        view = self._build_view()   # as of now, before the stretch; reported only if there is one
        starts = self.engine.steps_ahead_starts()
        if starts is not None:
            last = len(starts) - 1
            self._ended_ahead = []
            ended = self.engine.steps_ahead_ended()
            if ended:
                ends = starts[1:].tolist() + [self.engine.clock()]
                before = [(ends[j], request) for j, requests in sorted(ended.items()) if j < last
                          for request in requests]
                for _, request in before:
                    self._ended(request)
                at_last = len(ended.get(last, ()))
                if before:   # the view as of the last step's start: after the earlier steps' ends
                    view = self._build_view()
                    view.num_running += at_last
                    view.num_decoding = view.num_running
                    self._ended_ahead = [t for t, _ in before]
                for request in ended.get(last, ()):
                    self._ended(request)
                self.num_decoding = sum(1 for r in self.engine.scheduler.running if r.num_output_tokens > 0)
            self._reported, self._since = view, []
            self._view = None   # as after any step: the next view is built anew
            if len(starts) >= 2:
                view.num_free_blocks = int(self.engine.steps_ahead_column("kv_blocks_free")[-2])
        return starts

    def take_steps_ahead(self, count: int) -> StepsAhead:
        """The next ``count`` steps computed ahead (``steps_ahead_starts`` said there are), handed out."""
        ahead = self.engine.take_steps_ahead(count)
        assert ahead is not None   # the caller saw their start times
        return ahead

    def step(self) -> StepOutput:
        """One engine step; the figures the views read follow what it did."""
        if self.engine.has_stretch():
            # A step of a decode stretch, computed ahead: no request starts or changes its queued tokens, the
            # figures already count those that end in it (``steps_ahead_starts``), and no request is routed here
            # before the stretch is over, so the views need nothing new.
            return self.engine.step()
        self._report_view()
        output = self.engine.step()
        self._view = None
        if output.plan is not None:
            for request, _ in output.plan.scheduled:
                self._track(request)
            for request in output.plan.preempted:
                self._track(request)
        for request in output.handed_off:   # prefilled here, decoded elsewhere: its TTFT is this replica's
            self._forget(request)
            assert request.first_token_time is not None  # its prefill sampled the first token here
            self._recent.append((request.first_token_time - request.arrival_time, None))
            self._update_recent()
        for request in output.finished:
            self._ended(request)
        self.num_decoding = sum(1 for r in self.engine.scheduler.running if r.num_output_tokens > 0)
        return output

    def die(self) -> tuple[list[Request], list[Request]]:
        """The replica is gone (a simulated fault): routers see it dead, its engine is dropped with its cache.
        Returns (its unfinished requests, each reset to resume elsewhere from its prompt and generated tokens,
        recomputed there; the requests that had ended in it and were not reported yet)."""
        unfinished, ended = self.engine.scheduler.drain()
        for request in unfinished:
            _reset_for_resume(request)
        self.alive, self.hung, self._view, self._reported, self._since = False, False, None, None, []
        self._queued.clear()
        self.num_queued_tokens = self.num_decoding = self.num_incoming = 0
        return unfinished, ended

    def restart(self, engine: LLMEngine, t: float) -> None:
        """Serve again at ``t`` with ``engine``, a fresh one (empty queues and cache) built for this replica."""
        self.engine, self.alive, self._view = engine, True, None
        self.wake(t)

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` is unfinished here (for an abort: a scan, as aborts are rare)."""
        return any(request.request_id == request_id for request in self._queued)

    def has_unfinished(self) -> bool:
        return self.alive and self.engine.has_unfinished()

    # -- what a router sees --------------------------------------------------------------------------------------
    def view(self, request: Request, now: float | None = None) -> ReplicaView:
        """This replica as a router sees it while ``request`` is being routed at ``now`` (built anew only when
        the replica changed since the last one).

        A simulated step is computed when it starts, so while it is in progress (``now`` before the replica's
        clock) the engine already holds the step's outcome, which no real router could know yet. Then the view
        is what a real router sees of a real replica (``RayCluster``): the replica as of its last step, plus the
        requests routed to it since, counted as waiting and their prompts as queued tokens. (Its prefix matches
        are the cache's now.)"""
        if now is not None and self._reported is not None and now < self.engine.clock():
            return self._in_step_view().bind(request)
        if self._view is None:
            self._view = self._build_view()
        return self._view.bind(request)

    def num_outstanding(self, now: float | None = None) -> int:
        """``view(request, now).num_outstanding`` without building the view (the cluster's load-imbalance figure
        reads it of every replica at every arrival)."""
        if now is not None and self._reported is not None and now < self.engine.clock():
            # Requests that ended later in a stretch running ahead were still outstanding at ``now``.
            ended = self._ended_ahead
            later = len(ended) - bisect.bisect_right(ended, now) if ended else 0
            return self._reported.num_outstanding + len(self._since) + self.num_incoming + later
        scheduler = self.engine.scheduler
        return len(scheduler.running) + len(scheduler.waiting) + self.num_incoming

    def _report_view(self) -> None:
        """A step starts: the view as of now is what routers see until it ends (``view``)."""
        self._reported, self._since, self._ended_ahead = self._build_view(), [], []

    def _in_step_view(self) -> ReplicaView:
        assert self._reported is not None  # view() asks for it only while a step's view is reported
        view = copy.copy(self._reported)
        view.num_waiting += len(self._since) + self.num_incoming
        view.num_queued_tokens += sum(_tokens_to_compute(r) for r in self._since) + self.num_incoming
        view.num_routed = self.num_routed
        return view

    def _build_view(self) -> ReplicaView:
        scheduler, allocator, config = self.engine.scheduler, self.engine.allocator, self.engine.config
        return ReplicaView(
            index=self.view_index, alive=self.alive, num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + self.num_incoming, num_free_blocks=allocator.num_free_blocks(),
            num_total_blocks=allocator.num_blocks, block_size=allocator.block_size,
            num_queued_tokens=self.num_queued_tokens + self.num_incoming,
            num_decoding=self.num_decoding,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            recent_ttft=self.recent_ttft, recent_itl=self.recent_itl,
            num_routed=self.num_routed, prefix_lookup=scheduler.cached_prefix_len,   # tiers included
        )

    def describe(self) -> dict[str, Any]:
        """The settings that can differ between replicas (what ``metrics.json`` lists per replica)."""
        config = self.engine.config
        return {"replica": self.index, "num_kv_blocks": self.engine.num_kv_blocks, "block_size": config.block_size,
                "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
                "policy": self.engine.policy.registered_name, "allocator": self.engine.allocator.registered_name}

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def _track(self, request: Request) -> None:
        if request.is_finished:
            return
        uncomputed = _tokens_to_compute(request)
        self.num_queued_tokens += uncomputed - self._queued.get(request, 0)
        self._queued[request] = uncomputed

    def _update_recent(self) -> None:
        # ``statistics.fmean`` is fsum / n; spelled out, without its generator wrapper (once a finished request).
        self.recent_ttft = math.fsum(ttft for ttft, _ in self._recent) / len(self._recent)
        itls = [itl for _, itl in self._recent if itl is not None]
        self.recent_itl = math.fsum(itls) / len(itls) if itls else None

    def _ended(self, request: Request) -> None:
        """``request`` ended here: it leaves the queued tokens, and its latencies join the recent ones."""
        self._forget(request)
        if request.first_token_time is not None:
            self._recent.append((request.first_token_time - request.arrival_time, _mean_itl(request)))
            self._update_recent()

    def _forget(self, request: Request) -> None:
        self.num_queued_tokens -= self._queued.pop(request, 0)


def _reset_for_resume(request: Request) -> None:
    """``request`` as another replica takes it after its replica died: nothing of it is in any cache (its
    prompt and generated tokens are recomputed, as after a preemption), and K/V on their way to the dead replica
    are lost (``handoff.failed``). ``max_computed_tokens`` restarts at 0, as a real resume's does, so the
    recompute is counted as the retry's (``retry_recomputed_tokens``), not as a preemption's."""
    request.status = RequestStatus.WAITING
    request.num_computed_tokens = 0
    request.block_table = []
    request.max_computed_tokens = 0
    request.spec_token_ids = []
    if request.awaits_kv:
        assert request.handoff is not None   # awaits_kv says so
        request.handoff.failed, request.handoff.data = True, None


def _tokens_to_compute(request: Request) -> int:
    """Tokens ``request`` still needs computed here (a handed-off one awaiting its K/V: only those past them)."""
    handoff = request.handoff
    done = handoff.num_tokens if handoff is not None and request.awaits_kv else request.num_computed_tokens
    return request.num_tokens - done


def _mean_itl(request: Request) -> float | None:
    times = request.token_times
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


class ReplicaViews(Sequence[ReplicaView]):
    """The views of ``replicas`` for routing ``request`` at ``now`` (``LocalReplica.view``), each built when a
    router first reads it: a router that looks at one replica (round_robin) builds one view, not one a replica."""

    def __init__(self, replicas: Sequence[LocalReplica], request: Request, now: float) -> None:
        self._replicas = replicas
        self._request = request
        self._now = now
        self._views: list[ReplicaView | None] = [None] * len(replicas)

    def __len__(self) -> int:
        return len(self._replicas)

    @overload
    def __getitem__(self, index: int) -> ReplicaView: ...

    @overload
    def __getitem__(self, index: slice) -> list[ReplicaView]: ...

    def __getitem__(self, index: int | slice) -> ReplicaView | list[ReplicaView]:
        if isinstance(index, slice):
            return [self[position] for position in range(*index.indices(len(self)))]
        view = self._views[index]
        if view is None:
            view = self._views[index] = self._replicas[index].view(self._request, self._now)
        return view

    def loads(self) -> list[int]:
        """Each live replica's ``num_outstanding``, as its view would say, without building the views."""
        return [replica.num_outstanding(self._now) for replica in self._replicas if replica.alive]
