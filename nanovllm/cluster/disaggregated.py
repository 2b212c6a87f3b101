"""Prefill/decode disaggregation in one process: ``DisaggregatedCluster`` is a ``Cluster`` of two pools, prefill
replicas and decode replicas, each behind a router of its own, driven like one engine.

One request's path (DistServe's):

1. It arrives; the **prefill router** chooses among the prefill replicas' views (``route``), and the request
   joins that replica with ``hand_off_after_prefill`` set.
2. The prefill replica schedules it like any request (chunked prefill, prefix caching, preemption all apply)
   and samples its **first token** there. If that token ends it (EOS, ``max_tokens=1``), it finishes there.
   Otherwise the engine reads the prompt's blocks (``Runner.read_kv``), frees them (a prefix cache keeps their
   content) and hands the request off (``StepOutput.handed_off``, with ``request.handoff``: a ``KVHandoff``).
3. The **decode router** chooses among the decode replicas' views (the K/V on the way count as waiting there),
   and the ``KVTransfer`` moves the blocks: real engines hand the tensor over in this process (``local``); a
   simulated cluster moves nothing and delivers the request after ``KVTransfer.modelled_time(bytes)`` seconds,
   one transfer at a time per prefill replica's link (a transfer waits for the one before it).
4. On arrival the decode replica's engine queues it (``LLMEngine.add_handed_off``); at admission its scheduler
   allocates every block like any allocation (its prefix cache's hits first), and the step loads the K/V into
   the blocks that were not hits. A decode replica without free blocks keeps it waiting; a preempted request
   is recomputed there as any other. It then decodes to the end.

Replica indices are global (prefill replicas first: 0..P-1, then decode P..P+D-1) in records and steps; each
router sees only its pool's views, indexed 0..n-1 within the pool, and hears ``on_arrival``/``on_finish`` for
its pool (a prefill replica's ``on_finish`` comes at the hand-off). The real multi-process version is
``nanovllm.cluster.ray_replicas.RayCluster`` with ``prefill_replicas``/``decode_replicas``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from typing import Any, Sequence

from nanovllm.cluster.cluster import Cluster
from nanovllm.cluster.kv_transfer import KVTransfer, KVTransferError, LocalTransfer, fit_handoff
from nanovllm.cluster.replica import LocalReplica
from nanovllm.engine.engine import LLMEngine
from nanovllm.engine.protocol import StepOutput
from nanovllm.request import Request, RequestStatus
from nanovllm.router import ROUTERS, Router, StepTimeEstimate


class DisaggregatedCluster(Cluster):
    """``prefill`` engines behind ``prefill_router``, ``decode`` engines behind ``decode_router``, K/V moved by
    ``transfer`` (its ``modelled_time`` when the engines are simulated); ``faults``: ``Cluster``'s keyword
    arguments (``faults``, ``max_retries``, ``max_restarts``, ``step_timeout``, ``replica_factory``). See the
    module docstring."""

    def __init__(self, prefill: Sequence[LLMEngine], decode: Sequence[LLMEngine], prefill_router: Router,
                 decode_router: Router, transfer: KVTransfer | None = None,
                 step_time: StepTimeEstimate | None = None, **faults: Any) -> None:
        if not prefill or not decode:
            raise ValueError("a disaggregated cluster needs cluster.prefill_replicas >= 1 and "
                             f"cluster.decode_replicas >= 1, got {len(prefill)} and {len(decode)}")
        if prefill_router is decode_router:
            raise ValueError("the prefill and decode pools need a router instance each (router.prefill and "
                             "router.decode build one per pool)")
        super().__init__([*prefill, *decode], prefill_router, step_time, **faults)
        self.num_prefill = len(prefill)
        self.replicas = [LocalReplica(index, engine, view_index=index if index < self.num_prefill
                                      else index - self.num_prefill)
                         for index, engine in enumerate([*prefill, *decode])]
        self.decode_router = decode_router
        if step_time is not None:
            decode_router.bind_step_time(step_time)
        self.transfer = transfer if transfer is not None else LocalTransfer()
        for engine in (*prefill, *decode):
            self.transfer.check(engine.config)
        self.simulated = not prefill[0].runner.loads_model
        if self.simulated:
            self.transfer.modelled_time(0)   # fails now, naming the fix, if the link has no figures
        # (delivery time, order, request, decode replica): handed-off requests whose K/V are on the way.
        self._transit: list[tuple[float, int, Request, int]] = []
        self._order = itertools.count()
        self._link_free = [0.0] * self.num_prefill   # simulated: when each prefill replica's link is next free
        self.decode_imbalance: list[float] = []

    @property
    def prefill_replicas(self) -> list[LocalReplica]:
        return self.replicas[:self.num_prefill]

    @property
    def decode_replicas(self) -> list[LocalReplica]:
        return self.replicas[self.num_prefill:]

    def pool_of(self, index: int) -> str:
        """"prefill" or "decode": the pool replica ``index`` (global) serves in."""
        return "prefill" if index < self.num_prefill else "decode"

    # -- requests ----------------------------------------------------------------------------------------------
    def add_request(self, request: Request, error: str | None = None) -> None:
        request.hand_off_after_prefill = True
        super().add_request(request, error)

    def _route(self, request: Request, now: float) -> int:
        """The prefill router's choice (a prefill replica's index is the same in the pool and the cluster)."""
        return self._choose(request, [replica.view(request, now) for replica in self.prefill_replicas], now)

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self._transit)

    def abort_all(self, reason: str = "aborted") -> list[str]:
        """Abort every request, those whose K/V are on the way too (delivered now, then aborted there)."""
        while self._transit:
            t, _, request, index = heapq.heappop(self._transit)
            self._deliver(request, index, t)
        return super().abort_all(reason)

    def abort_request(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort ``request_id`` wherever it is; one whose K/V are on the way is delivered now, then aborted."""
        for entry in [e for e in self._transit if e[2].request_id == request_id]:
            self._transit.remove(entry)
            heapq.heapify(self._transit)
            t, _, request, index = entry
            self._deliver(request, index, t)
        return super().abort_request(request_id, reason)

    # -- the step ----------------------------------------------------------------------------------------------
    def next_ready_time(self) -> float | None:
        times = [t for t in (super().next_ready_time(), self._next_delivery()) if t is not None]
        return min(times) if times else None

    def _next_delivery(self) -> float | None:
        return self._transit[0][0] if self._transit else None

    def _next_arrival_at(self, index: int) -> float:
        """Any replica's horizon is the next arrival: a prefill replica's pool router may send it anywhere, and
        a decode replica's requests come from prefill steps (``_replica_horizon``)."""
        assert self._horizon is not None
        return self._horizon

    def _replica_horizon(self, index: int) -> float | None:
        """As ``Cluster``'s, and a decode replica's also ends at the next step of a busy prefill replica: that
        step may hand a request off, routed by the views of the decode replicas as of then."""
        horizon = super()._replica_horizon(index)
        if horizon is None or index < self.num_prefill:
            return horizon
        busy = [replica.engine.next_step_time() for replica in self.prefill_replicas if replica.has_unfinished()]
        return min([horizon, *busy])

    def _deliver_next(self) -> None:
        """The transfers due before the next step are delivered (``Cluster._advance``, in time order with the
        faults); the step then runs the replica whose clock is earliest."""
        t, _, request, index = heapq.heappop(self._transit)
        self._deliver(request, index, t)

    def _take_incoming(self, index: int) -> list[Request]:
        """The requests whose K/V were on their way to dead decode replica ``index``: lost with it, so each
        resumes on another decode replica that computes its prompt (``ClusterBase._recover``)."""
        taken = [entry for entry in self._transit if entry[3] == index]
        if not taken:
            return []
        self._transit = [entry for entry in self._transit if entry[3] != index]
        heapq.heapify(self._transit)
        for _, _, request, _ in taken:
            request.status = RequestStatus.WAITING
            assert request.handoff is not None   # only handed-off requests are in transit
            request.handoff.failed, request.handoff.data = True, None
        return [request for _, _, request, _ in taken]

    def _stepped(self, replica: LocalReplica, output: StepOutput, now: float) -> None:
        """Each pool's router hears of the requests that ended on its replicas; a prefill replica's handed-off
        requests end there (its router's ``on_finish``) and go on to a decode replica."""
        self._hear_ended(replica, output.finished, now)
        for request in output.handed_off:
            self._ask("on_finish", request, replica.view_index, now)
            if not self._hand_off(request, replica.index, now):
                output.finished.append(request)

    def _hear_ended(self, replica: LocalReplica, requests: Sequence[Request], now: float) -> None:
        """The router of ``replica``'s pool (prefill or decode) hears that ``requests`` ended there."""
        router = self.router if replica.index < self.num_prefill else self.decode_router
        for request in requests:
            self._ask("on_finish", request, replica.view_index, now, router=router)

    def _hand_off(self, request: Request, prefill_index: int, now: float) -> bool:
        """Route a prefilled request to a decode replica and start moving its K/V there (with
        ``cluster.faults.kv_transfer_failure``, the move may fail: the decode replica then computes the prompt).
        With no decode replica alive, its K/V wait for the one whose restart is due first (delivered when it
        serves again); False when none is coming back: the request ends failed, with the reason."""
        spot = None
        if not any(replica.alive for replica in self.decode_replicas):
            spot = self._parking_spot(self.decode_replicas)
            if spot is None:
                request.status, request.finish_time = RequestStatus.FAILED, now
                request.error = "no live decode replica is left to hand the request off to"
                return False
        if spot is None:
            views = [replica.view(request, now) for replica in self.decode_replicas]
            local = self._choose(request, views, now, self.decode_router, self.decode_imbalance)
        else:
            local = spot.view_index
        index = self.num_prefill + local
        handoff = request.handoff
        assert handoff is not None, "the engine hands a request off with its KVHandoff"
        if self.simulated:
            start = max(now, self._link_free[prefill_index])
            done = start + self.transfer.modelled_time(handoff.num_bytes)
            self._link_free[prefill_index] = done
            handoff.transfer_time = done - now   # waiting for the link included
            if self._injector is not None and self._injector.transfer_fails():
                handoff.failed = True   # found when it should have arrived: nothing to load there
        else:   # real engines in this process: the tensor is handed over (the read and write are timed)
            started = time.perf_counter()
            try:
                handle = self.transfer.send_request(self.replicas[prefill_index].engine, request, handoff.data)
                fit_handoff(handoff, self.transfer.receive_request(self.replicas[index].engine, request, handle),
                            self.replicas[index].engine.config.block_size)
            except KVTransferError as exc:   # the decode replica computes the prompt itself
                logging.getLogger(__name__).warning("request %s: %s; its decode replica recomputes the prompt",
                                                    request.request_id, exc)
                handoff.failed, handoff.data = True, None
            handoff.transfer_time += time.perf_counter() - started
            done = now
        self._ask("on_arrival", request, local, now, router=self.decode_router)
        if spot is not None:   # its K/V wait for the decode replica's restart
            self._park(spot, request, kv_arrival=done)
            return True
        self._deliver_later(index, request, done)
        return True

    def _deliver_later(self, index: int, request: Request, t: float) -> None:
        self.replicas[index].expect()
        heapq.heappush(self._transit, (t, next(self._order), request, index))

    def _deliver(self, request: Request, index: int, t: float) -> None:
        replica = self.replicas[index]
        if not replica.engine.has_unfinished():
            replica.wake(t)
        request.replica = index
        replica.add_handed_off(request)
        assert request.handoff is not None   # only handed-off requests are in transit
        request.handoff.arrival_time = t   # (a simulated replica may be mid-step)
        self._watch(replica, t)
        self._mark_ready(index)


def pool_routers(spec: Any) -> tuple[Router, Router]:
    """One router instance per pool from a ``router`` spec (``pool_router_specs``); a ``Router`` instance given
    as the whole spec serves the prefill pool, and the decode pool gets a fresh one of its class."""
    if isinstance(spec, Router):
        return spec, type(spec)()
    prefill, decode = pool_router_specs(spec)
    return ROUTERS.build(prefill), ROUTERS.build(decode)


def pool_router_specs(spec: Any) -> tuple[Any, Any]:
    """The prefill and decode pools' router specs from one ``router`` spec: its ``prefill`` and ``decode`` keys
    (a name or ``{name, **options}``; null: the spec's own router, built once per pool)."""
    if not isinstance(spec, dict) and hasattr(spec, "items"):
        spec = dict(spec.items())
    if not isinstance(spec, dict):
        return spec, spec
    base = {key: value for key, value in spec.items() if key not in ("prefill", "decode")}
    prefill, decode = spec.get("prefill"), spec.get("decode")
    return (base if prefill is None else prefill), (base if decode is None else decode)


__all__ = ["DisaggregatedCluster", "pool_router_specs"]
