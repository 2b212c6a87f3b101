"""``Cluster``: N engine replicas behind one ``Router``, driven like one engine. The serving loops that drive an
``LLMEngine`` (``nanovllm.harness.serving.serve``, ``LLM.generate``) drive a cluster through the same calls:
``make_request``, ``add_request`` (the router picks the replica here), ``step`` (one replica runs one step),
``has_unfinished``, ``abort_all``.

Time. Each simulated replica has its own virtual clock. ``ClusterClock.now()`` is the start of the next step
the cluster will run: the earliest clock among replicas with work; ``step`` runs that replica. A request is
routed at its arrival time, before any step that starts after it, and an idle replica's clock jumps to the
arrival of the request it is given. So every replica's steps, and every routing decision, happen in time
order on one timeline, as a discrete-event simulation, whatever the number of replicas.

A step is computed when it starts (as the one-engine simulator does), so while a replica's step is in progress
its engine already holds the step's outcome. A request routed then sees what a real router sees of a real replica
(``RayCluster``): the replica as of its last step plus what was routed to it since (``LocalReplica.view``), one
step old, as a report from a replica mid-step is.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import deque
from typing import Any, Callable, Mapping, Sequence


from nanovllm.cluster.faults import DEATH, HANG, RESTART, FaultInjector, FaultsConfig, death_record
from nanovllm.cluster.replica import LocalReplica, ReplicaViews
from nanovllm.engine.engine import LLMEngine
from nanovllm.engine.protocol import EngineClient, StepOutput, StepsAhead
from nanovllm.outputs import StepColumns
from nanovllm.request import Request, RequestStatus
from nanovllm.router import Router, RouterError, StepTimeEstimate, check_route
from nanovllm.sampling import SamplingParams


# What an arrival ends with when its pool (every replica, or the prefill pool) has no live replica: a simulated and a
# real cluster alike fail it at once rather than hold it for a restart that may never come.
NO_LIVE_REPLICA = "no live replica is left to route it to (every replica died)"


class ClusterClock:
    """The serving loop's clock over a cluster of virtual-clock replicas (see the module docstring)."""

    def __init__(self, cluster: "Cluster") -> None:
        self._cluster = cluster
        self._idle_time = 0.0   # where time stands while no replica has work

    def now(self) -> float:
        busy = self._cluster.next_ready_time()
        if busy is not None:
            return busy
        # Idle, time stands at the last arrival waited for. Once the driver says none is to come (an infinite
        # horizon), the run is over where its last step ended (a replica's clock stands at its last step's end),
        # which is what the run's length reads; only then, so nothing the run does depends on it.
        if self._cluster.no_more_requests():
            return max(self._idle_time, max(engine.clock() for engine in self._cluster.engines))
        return self._idle_time

    def __call__(self) -> float:
        return self.now()

    def wait_until(self, t: float, stop: threading.Event | None = None) -> None:
        """Idle until ``t`` (only called while no replica has work: the loop waits for the next arrival)."""
        self._idle_time = max(self._idle_time, t)


class ClusterBase(EngineClient):
    """What every cluster shares: requests checked against every replica's limits, and the router's checked
    choices. ``_validators`` holds one engine (or stand-in) per distinct replica limits (``max_model_len``, KV
    cache, block size): a request must fit every replica, since the router may send it to any."""

    router: Router
    imbalance: list[float]             # max / mean outstanding requests over replicas, at each arrival
    _validators: Sequence[Any]
    replicas: Sequence[Any]            # LocalReplica or RemoteReplica: index, view_index, alive
    # Prefill/decode disaggregation (0 / None: colocated replicas): the first ``num_prefill`` replicas prefill,
    # the others decode behind ``decode_router``.
    num_prefill: int = 0
    decode_router: Router | None = None
    decode_imbalance: list[float]
    max_retries: int = 3               # resumes a request may have after its replica died (cluster.max_retries)
    num_deaths: int = 0                # replica deaths so far (each one's requests went through _recover)
    _reports: deque[StepOutput]        # what ended outside a step (deaths, arrivals failed), for the next step

    def make_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                     **fields: Any) -> Request:
        """Tokenize and validate against every distinct replica's limits (``ValueError`` naming the field)."""
        request = self._validators[0].make_request(prompt, sampling_params, **fields)
        for engine in self._validators[1:]:
            engine.make_request(request.prompt_token_ids, request.sampling_params, **fields)
        return request

    def rejected_request(self, prompt: str | list, sampling_params: SamplingParams, **fields: Any) -> Request:
        return self._validators[0].rejected_request(prompt, sampling_params, **fields)

    def _choose(self, request: Request, views: Sequence[Any], now: float, router: Router | None = None,
                imbalance: list[float] | None = None) -> int:
        """``router``'s (default: the cluster's) checked choice among ``views``; the load imbalance it found is
        noted in ``imbalance`` (default: ``self.imbalance``)."""
        router = self.router if router is None else router
        self._note_imbalance(views, self.imbalance if imbalance is None else imbalance)
        try:
            choice = router.route(request, views, now)
        except RouterError:
            raise
        except Exception as exc:
            raise RouterError(f"router {router.registered_name!r} raised in route(): "
                              f"{type(exc).__name__}: {exc}") from exc
        return check_route(router, choice, views)

    @staticmethod
    def _note_imbalance(views: Sequence[Any], imbalance: list[float]) -> None:
        loads = views.loads() if isinstance(views, ReplicaViews) else \
            [view.num_outstanding for view in views if view.alive]
        total = sum(loads)
        imbalance.append(max(loads) * len(loads) / total if total else 1.0)

    # -- recovery: what every cluster does when a replica dies (simulated or a Ray actor) -----------------------
    def _recover(self, dead: Any, held: Sequence[Request], reason: str, now: float,
                 aborts: Mapping[str, str] | None = None, abort_all: str | None = None) -> list[Request]:
        """``dead`` is gone with ``held``, its unfinished requests: each resumes on a live replica of its pool
        (``_retry``), or ends: aborted when an abort was on its way to it (``aborts``: id -> reason, or
        ``abort_all``), failed with ``reason`` when it was retried ``max_retries`` times or no replica of its pool
        is alive. ``dead``'s router hears ``on_finish`` for every one. Returns the requests that ended."""
        aborts = aborts or {}
        self.num_deaths += 1
        retry: list[Request] = []
        ended: list[Request] = []
        for request in held:
            abort = aborts.get(request.request_id, abort_all)
            if abort is not None:   # the client gave up on it already: no reason to resume it
                request.status, request.error, request.finish_reason = RequestStatus.ABORTED, abort, "abort"
                request.finish_time = now
                ended.append(request)
            elif request.num_retries >= self.max_retries:
                request.status, request.error, request.finish_time = RequestStatus.FAILED, reason, now
                if self.max_retries:
                    request.error += f" (retried {request.num_retries} times: cluster.max_retries)"
                ended.append(request)
            else:
                retry.append(request)
        router = self._pool(dead.index)[1]
        for request in held:   # its replica's router hears every one end there, retried or not
            self._ask("on_finish", request, dead.view_index, now, router=router)
        for request in retry:
            if not self._retry(request, dead, now):
                request.status, request.finish_time = RequestStatus.FAILED, now
                request.error = f"{reason} (no live replica is left to retry it on)"
                ended.append(request)
        return ended

    def _pool(self, index: int) -> tuple[Sequence[Any], Router, list[float]]:
        """Replica ``index``'s pool (its replicas, router and load-imbalance list): with disaggregation the
        prefill or the decode pool, else every replica."""
        if self.num_prefill and index >= self.num_prefill:
            assert self.decode_router is not None   # a disaggregated cluster is built with one
            return self.replicas[self.num_prefill:], self.decode_router, self.decode_imbalance
        pool = self.replicas[:self.num_prefill] if self.num_prefill else self.replicas
        return pool, self.router, self.imbalance

    def _retry(self, request: Request, dead: Any, now: float) -> bool:
        """Route ``request``, held by ``dead``, to a live replica of the same pool (a decode replica's to a decode
        replica: it recomputes the prompt and the tokens generated so far, no K/V moved) and queue it to resume
        there (``_resume_on``); with none alive, to the pool's ``_parking_spot``. False when there is neither."""
        pool, router, imbalance = self._pool(dead.index)
        spot = None if any(replica.alive for replica in pool) else self._parking_spot(pool)
        if spot is None and not any(replica.alive for replica in pool):
            return False
        if self.num_prefill and dead.index >= self.num_prefill:
            request.hand_off_after_prefill = False   # it decodes where it goes
        request.retried_from.append(dead.index)
        if request.num_output_tokens:   # the dead replica had computed all but the newest token
            request.retry_recomputed_tokens += request.num_tokens - 1
        if spot is not None:
            target, local = spot, spot.view_index
        else:
            views = self._retry_views(pool, request, now)
            local = self._choose(request, views, now, router, imbalance)
            target = pool[local]
        request.replica = target.index
        self._resume_on(target, request, now)
        self._ask("on_arrival", request, local, now, router=router)
        return True

    def _parking_spot(self, pool: Sequence[Any]) -> Any:
        """Where a request waits when no replica of ``pool`` is alive: a replica that will serve again (a Ray
        actor being relaunched, a simulated replica whose restart is due after ``cluster.faults.restart_delay``),
        whose queue it joins until the replica rejoins; None when none is coming back (it fails)."""
        return None

    def _fail_no_replica(self, request: Request, pool: Sequence[Any], now: float) -> None:
        """An arrival when every replica of its ``pool`` died for good: it ends failed with the reason, reported by
        the next step (a model-free record of the pool's first replica), rather than the router raising."""
        request.status, request.finish_time, request.error = RequestStatus.FAILED, now, NO_LIVE_REPLICA
        self._reports.append(StepOutput([request], death_record(pool[0].index, now, 0)))

    def _retry_views(self, pool: Sequence[Any], request: Request, now: float) -> list[Any]:
        """The views of ``pool`` a retried ``request`` is routed on."""
        return [replica.view(request, now) for replica in pool]

    def _resume_on(self, target: Any, request: Request, now: float) -> None:
        """Queue ``request`` on ``target`` to resume from its prompt and generated tokens (each cluster's own)."""
        raise RuntimeError(f"{type(self).__name__} cannot resume a request on another replica")

    def _ask(self, method: str, *args: Any, router: Router | None = None) -> None:
        router = self.router if router is None else router
        try:
            getattr(router, method)(*args)
        except Exception as exc:
            raise RouterError(f"router {router.registered_name!r} raised in {method}(): "
                              f"{type(exc).__name__}: {exc}") from exc


class Cluster(ClusterBase):
    """Replicas (``LocalReplica``) and the router that spreads requests over them, in this process.

    ``replicas[0]``'s engine tokenizes (every replica serves the same model); a request must fit every replica
    (each one's ``max_model_len`` and KV cache), since the router may send it to any.
    """

    replicas: list[LocalReplica]

    def __init__(self, engines: Sequence[LLMEngine], router: Router,
                 step_time: StepTimeEstimate | None = None, *, faults: FaultsConfig | None = None,
                 max_retries: int = 3, max_restarts: int = 0, step_timeout: float | None = None,
                 replica_factory: Callable[[int], LLMEngine] | None = None) -> None:
        """``faults``: the faults to inject (``cluster.faults``), recovered as ``RayCluster`` recovers a dead
        actor: ``max_retries`` resumes per request, ``max_restarts`` engines built anew per replica by
        ``replica_factory(index)`` (needed when ``max_restarts`` > 0) ``faults.restart_delay`` seconds after a
        death; ``step_timeout``: a replica with work and no step for that long is dead (a hang)."""
        if not engines:
            raise ValueError("cluster.replicas must be >= 1")
        self.replicas = [LocalReplica(index, engine) for index, engine in enumerate(engines)]
        self.engines = list(engines)
        self.router = router
        if step_time is not None:
            router.bind_step_time(step_time)
        self.clock = ClusterClock(self)
        self._ready: list[tuple[float, int]] = []   # (clock, replica index) of replicas with work: a heap
        self._in_ready = [False] * len(self.replicas)
        limits: dict[tuple[int, int, int], LLMEngine] = {}
        for engine in engines:
            limits.setdefault((engine.max_model_len, engine.num_kv_blocks, engine.config.block_size), engine)
        self._validators = list(limits.values())
        self.imbalance = []
        first = engines[0]   # every replica serves the same model
        self.config, self.tokenizer, self.hf_config, self.model_dir = \
            first.config, first.tokenizer, first.hf_config, first.model_dir
        self.max_model_len = min(engine.max_model_len for engine in engines)
        self.num_kv_blocks = min(engine.num_kv_blocks for engine in engines)
        self.warmup_time = sum(engine.warmup_time for engine in engines)
        self.warmup_steps = sum(engine.warmup_steps for engine in engines)
        self.decode_imbalance = []
        self.max_retries, self.max_restarts, self.step_timeout = max_retries, max_restarts, step_timeout
        if max_restarts and replica_factory is None:
            raise ValueError("a simulated cluster restarts a dead replica with a fresh engine: cluster.max_restarts "
                             "> 0 needs a replica_factory")
        self._replica_factory = replica_factory
        self.faults = faults if faults is not None else FaultsConfig()
        if self.faults.hangs and step_timeout is None:
            raise ValueError("cluster.faults.hangs need cluster.step_timeout: a hung replica is found dead only "
                             "when it has not stepped for that long")
        self._detections: dict[int, float] = {}   # hung replica with work -> when it is found dead
        # A dead replica whose restart is queued -> when it serves again; and the requests waiting for it (while
        # no replica of its pool is alive), queued on it when it restarts, as RayCluster's relaunch does.
        self._restart_at: dict[int, float] = {}
        # (request, refusal error, when its K/V arrive: a decode hand-off's, else None)
        self._parked: dict[int, list[tuple[Request, str | None, float | None]]] = {}
        self._reports: deque[StepOutput] = deque()   # what deaths ended, reported by the next steps
        self._horizon: float | None = None   # the driver's: no request added before it (set_horizon)
        self._upcoming: Sequence[float] = ()  # the driver's: when the requests still to come arrive
        # Each replica's first coming arrival under the horizon above (``_next_arrival_at``), worked out once per
        # horizon and routing decision rather than once per replica per step; None: not worked out yet.
        self._first_arrivals: tuple[dict[int, float], float] | None = None
        # Fault times count from where the replicas' clocks start (the run's start for a simulated cluster).
        start = min(engine.clock() for engine in engines)
        self._injector = FaultInjector(self.faults, len(engines), start) if self.faults.active else None

    # -- requests ------------------------------------------------------------------------------------------------
    def add_request(self, request: Request, error: str | None = None) -> None:
        """Route ``request`` at its arrival time and queue it on the chosen replica (a refused one, with
        ``error``, is routed too and ends failed there at its next step)."""
        now = request.arrival_time
        self._advance(now)   # the faults due by its arrival happen first
        pool = self._pool(0)[0]
        if not any(replica.alive for replica in pool):
            spot = self._parking_spot(pool)
            if spot is None:   # every replica is dead for good: it ends failed, with the reason
                self._fail_no_replica(request, pool, now)
                return
            request.replica = spot.index
            self._park(spot, request, error)
            self._ask("on_arrival", request, spot.view_index, now)
            return
        index = self._route(request, now)
        request.replica = index
        self._queue(self.replicas[index], request, now, error)
        self._ask("on_arrival", request, index, now)

    def _queue(self, replica: LocalReplica, request: Request, now: float, error: str | None = None) -> None:
        if not replica.engine.has_unfinished():
            replica.wake(now)
        replica.add(request, error=error)
        self._watch(replica, now)
        self._mark_ready(replica.index)

    def _resume_on(self, target: Any, request: Request, now: float) -> None:
        """A dead replica's request resumes on ``target`` (``ClusterBase._retry``): queued like an arrival, its
        prompt and generated tokens computed there (or, ``target`` being dead with a restart due, parked)."""
        if target.alive:
            self._queue(target, request, now)
        else:
            self._park(target, request)

    def _parking_spot(self, pool: Sequence[Any]) -> Any:
        due = [replica for replica in pool if not replica.alive and replica.index in self._restart_at]
        return min(due, key=lambda replica: (self._restart_at[replica.index], replica.index), default=None)

    def _park(self, replica: LocalReplica, request: Request, error: str | None = None,
              kv_arrival: float | None = None) -> None:
        """``request`` waits for dead ``replica``'s restart, queued on it then (``_fault``, RESTART); a decode
        hand-off's K/V (due at ``kv_arrival``) are delivered to it then."""
        self._parked.setdefault(replica.index, []).append((request, error, kv_arrival))

    def _unpark(self, replica: LocalReplica, t: float) -> None:
        """``replica`` serves again at ``t``: the requests that waited for it are queued on it."""
        for request, error, kv_arrival in self._parked.pop(replica.index, []):
            if kv_arrival is None:
                self._queue(replica, request, t, error)
            else:
                self._deliver_later(replica.index, request, max(kv_arrival, t))

    def _deliver_later(self, index: int, request: Request, t: float) -> None:
        """Deliver a handed-off request's K/V to replica ``index`` at ``t`` (a disaggregated cluster's)."""
        raise RuntimeError(f"{type(self).__name__} hands no request off")

    def _end_parked(self, request_ids: set[str] | None, reason: str, now: float) -> list[str]:
        """Abort the parked requests with these ids (None: all), reported by the next step. Returns their ids."""
        ended: dict[int, list[Request]] = {}
        for index, parked in list(self._parked.items()):
            keep = []
            for request, error, kv_arrival in parked:
                if request_ids is None or request.request_id in request_ids:
                    request.status, request.error, request.finish_reason = RequestStatus.ABORTED, reason, "abort"
                    request.finish_time = now
                    ended.setdefault(index, []).append(request)
                else:
                    keep.append((request, error, kv_arrival))
            self._parked[index] = keep
        for index, requests in ended.items():
            for request in requests:   # its router was told it arrived at the parking replica
                self._ask("on_finish", request, self.replicas[index].view_index, now, router=self._pool(index)[1])
            self._reports.append(StepOutput(requests, death_record(index, now, 0)))
        return [request.request_id for requests in ended.values() for request in requests]

    def has_unfinished(self) -> bool:
        return bool(self._ready or self._reports or self._detections or any(self._parked.values()))

    def set_horizon(self, t: float | None, upcoming: Sequence[float] = ()) -> None:
        """No request is added or aborted before ``t`` (the driver's promise), and ``upcoming`` are the times of
        the requests still to come: each replica's engine is told, at its step, the time before which nothing
        can reach it (``_replica_horizon``)."""
        if t != self._horizon or len(upcoming) != len(self._upcoming):
            self._first_arrivals = None
        self._horizon = t
        self._upcoming = upcoming

    def no_more_requests(self) -> bool:
        """Whether the driver promised that no request is to come (``set_horizon(math.inf)``)."""
        return self._horizon == math.inf

    def _replica_horizon(self, index: int) -> float | None:
        """Before when nothing from outside can change replica ``index`` (arrivals, K/V deliveries); None with
        faults, whose recovery may move requests between replicas at any step."""
        if self._horizon is None or self._injector is not None or self._detections:
            return None
        arrival = self._next_arrival_at(index)
        delivery = self._next_delivery()
        return arrival if delivery is None else min(arrival, delivery)

    def _next_arrival_at(self, index: int) -> float:
        """The time of the first coming request that can reach replica ``index``: where the router says where
        the next requests go whatever the replicas' state (``Router.upcoming_routes``: round_robin), the first
        of those routed to it (the others do not change it; a refused request is routed too); otherwise the
        next request's."""
        assert self._horizon is not None
        if self._first_arrivals is None:
            self._first_arrivals = self._first_arrival_per_replica()
        first, otherwise = self._first_arrivals
        return first.get(index, otherwise)

    def _first_arrival_per_replica(self) -> tuple[dict[int, float], float]:
        """``_next_arrival_at`` for every replica: the replicas the coming routes name, with the first arrival
        routed to each, and the time for any other replica."""
        assert self._horizon is not None
        upcoming, count = self._upcoming, len(self.replicas)
        if not upcoming or not all(replica.alive for replica in self.replicas):
            return {}, self._horizon
        routes = self.router.upcoming_routes(min(count, len(upcoming)), count)
        if routes is None:
            return {}, self._horizon
        first: dict[int, float] = {}
        for position, route in enumerate(routes):
            first.setdefault(route, upcoming[position])
        return first, (upcoming[len(routes)] if len(routes) < len(upcoming) else math.inf)

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) requests over every live replica."""
        lengths = [replica.engine.queue_lengths() for replica in self.replicas if replica.alive]
        return sum(r for r, _ in lengths), sum(w for _, w in lengths)

    def abort_request(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort ``request_id`` on the replica that holds it (its next step reports it); False if none does."""
        for replica in self.replicas:
            if replica.alive and replica.holds(request_id):
                aborted = replica.engine.abort_request(request_id, reason)
                self._mark_ready(replica.index)
                return aborted
        return bool(self._end_parked({request_id}, reason, self.clock.now()))

    def abort_all(self, reason: str = "aborted") -> list[str]:
        """Abort every request on every live replica (each replica reports them at its next ``step``; a hung
        one, at once)."""
        ids: list[str] = []
        for replica in self.replicas:
            if replica.alive:
                ids += replica.engine.abort_all(reason)
                if replica.hung:   # it will never step: what it held is reported now, as its death's
                    self._kill(replica.index, replica.engine.clock(), reason)
                self._mark_ready(replica.index)
        return ids + self._end_parked(None, reason, self.clock.now())

    # -- the step ------------------------------------------------------------------------------------------------
    def next_ready_time(self) -> float | None:
        """When the next step starts: the earliest clock among replicas with work, or when a hung replica is
        found dead if that comes first, or when a replica that requests wait for restarts (None: nothing to
        do)."""
        times = [self._ready[0][0]] if self._ready else []
        if self._detections:
            times.append(min(self._detections.values()))
        times += [self._restart_at[index] for index, parked in self._parked.items() if parked]
        return min(times) if times else None

    def step(self) -> StepOutput:
        """Run one step of the replica whose clock is earliest; its record says which replica (``replica``).
        The faults due before it happen first; what a death ended is reported as a step of its own."""
        while True:
            horizon = self.next_ready_time()
            if horizon is None and not self._reports:
                raise RuntimeError("Cluster.step() called with no replica holding a request")
            if horizon is not None:
                self._advance(horizon)
            if self._reports:
                return self._reports.popleft()
            if self._ready and horizon is not None and self._ready[0][0] <= horizon:
                break
        _, index = heapq.heappop(self._ready)
        self._in_ready[index] = False
        replica = self.replicas[index]
        replica.engine.set_horizon(self._replica_horizon(index))
        replica.engine.stretch_through_finishes = self._stretches_through_finishes()
        output = replica.step()
        output.record["replica"] = index
        self._stepped(replica, output, replica.engine.clock())
        self._mark_ready(index)
        return output

    def take_steps_ahead(self) -> StepsAhead | None:
        """Each replica's decode stretch whole, while the replica whose step comes next (earliest start, ties
        by replica) has one to run: no request starts in it, and none reaches the replica before its last step
        starts (its engine's horizon, ``_replica_horizon``), so it is run ahead of the other replicas' steps;
        its records (each with its ``replica``) and the requests that ended in it settle as
        ``steps_settled_before`` says, and the router hears of those at once (``_hear_ended``). None when the next
        step is not one. Without faults only: a fault may move requests between replicas at any step."""
        if self._reports or self._injector is not None or self._detections or any(self._parked.values()):
            return None
        runs: list[StepColumns] = []
        ended: list[tuple[int, Request]] = []
        taken = 0
        through = self._stretches_through_finishes()
        while self._ready:
            index = self._ready[0][1]
            replica = self.replicas[index]
            replica.engine.set_horizon(self._replica_horizon(index))
            replica.engine.stretch_through_finishes = through
            ahead = replica.steps_ahead_starts()
            if ahead is None:
                break
            run = replica.take_steps_ahead(len(ahead))
            for steps in run.parts:
                steps.keys.append("replica")
                steps.constants["replica"] = index
                runs.append(steps)
            # The router hears of the requests that ended, as after each of their steps (at its end).
            for position, request in run.ended:
                ended.append((taken + position, request))
                assert request.finish_time is not None   # it ended in the stretch, at its step's end
                self._hear_ended(replica, [request], request.finish_time)
            taken += len(run)
            # Its next step goes back on the heap as ``step()`` would have left it after the stretch (an idle
            # replica, all of whose requests ended in it, leaves the heap until a request comes).
            if replica.has_unfinished():
                heapq.heapreplace(self._ready, (replica.engine.next_step_time(), index))
            else:
                heapq.heappop(self._ready)
                self._in_ready[index] = False
        return StepsAhead(runs, ended) if runs else None

    def _stretches_through_finishes(self) -> bool:
        """Whether replicas' decode stretches may run through the steps where requests finish: a router that
        hears each finish (its own ``on_finish``) would hear them out of order across replicas then."""
        return all(router is None or type(router).on_finish is Router.on_finish
                   for router in (self.router, self.decode_router))

    def steps_settled_before(self) -> float | None:
        """``EngineClient.steps_settled_before``: a replica's next step starts at its place on the heap, an idle
        one's at the next arrival (the driver's horizon) or K/V delivery at the earliest. None until the
        driver sets a horizon, and with faults (their steps come in order)."""
        if self._horizon is None or self._injector is not None:
            return None
        times = [self._horizon]
        for t in (self.next_ready_time(), self._next_delivery()):
            if t is not None:
                times.append(t)
        return min(times)

    def _stepped(self, replica: LocalReplica, output: StepOutput, now: float) -> None:
        """After ``replica``'s step: the router hears of the requests that ended there."""
        self._hear_ended(replica, output.finished, now)

    def _hear_ended(self, replica: LocalReplica, requests: Sequence[Request], now: float) -> None:
        """The router of ``replica``'s pool hears that ``requests`` ended there at ``now``."""
        for request in requests:
            self._ask("on_finish", request, replica.view_index, now)

    # -- helpers ---------------------------------------------------------------------------------------------
    def _route(self, request: Request, now: float) -> int:
        """The router's choice for ``request`` among the replicas' views, checked (RouterError otherwise)."""
        self._first_arrivals = None   # the router's state moves on: the coming routes change
        return self._choose(request, ReplicaViews(self.replicas, request, now), now)

    def _mark_ready(self, index: int) -> None:
        replica = self.replicas[index]
        if not self._in_ready[index] and not replica.hung and replica.has_unfinished():
            heapq.heappush(self._ready, (replica.engine.next_step_time(), index))
            self._in_ready[index] = True

    def _unready(self, index: int) -> None:
        if self._in_ready[index]:
            self._ready = [entry for entry in self._ready if entry[1] != index]
            heapq.heapify(self._ready)
            self._in_ready[index] = False

    # -- faults (``cluster.faults``) -------------------------------------------------------------------------
    def _advance(self, until: float) -> None:
        """Let happen, in time order, what is due by ``until``: the injected faults and a hung replica's
        detection (and, disaggregated, K/V transfers arriving: ``_next_delivery``)."""
        while True:
            fault = self._injector.next_time() if self._injector is not None else None
            delivery = self._next_delivery()
            if delivery is not None and delivery <= until and (fault is None or delivery <= fault):
                self._deliver_next()
            elif fault is not None and fault <= until:
                assert self._injector is not None   # a fault time comes from it
                event = self._injector.pop_due(until)
                assert event is not None
                self._fault(*event)
            else:
                return

    def _next_delivery(self) -> float | None:
        """When the next K/V transfer arrives (a disaggregated cluster's; None here)."""
        return None

    def _deliver_next(self) -> None:
        """Deliver the next K/V transfer (a disaggregated cluster's)."""

    def _fault(self, t: float, kind: str, index: int) -> None:
        replica = self.replicas[index]
        if kind == RESTART:
            assert self._replica_factory is not None   # restarts are queued only with one
            engine = self._replica_factory(index)
            self.engines[index] = engine
            replica.restart(engine, t)
            self._restart_at.pop(index, None)
            self._unpark(replica, t)
            return
        if not replica.alive:   # a death or hang of a replica that is dead already: void
            return
        if replica.engine.clock() > t:   # mid-step: the fault lands when the step in progress ends
            assert self._injector is not None   # events come from it
            self._injector.push(replica.engine.clock(), kind, index)
            return
        if kind == DEATH:
            self._kill(index, t, f"replica {index} died: fault injected (cluster.faults)")
        elif kind == HANG:
            replica.hung = True
            self._unready(index)
            self._watch(replica, t)
        else:   # the hang detection: no step within cluster.step_timeout while it had work
            if self._detections.get(index) == t:
                self._kill(index, t, f"replica {index} died: no step within cluster.step_timeout="
                                     f"{self.step_timeout:g} s")

    def _watch(self, replica: LocalReplica, now: float) -> None:
        """A hung replica that has work is found dead ``step_timeout`` seconds after the work was there."""
        if replica.hung and replica.index not in self._detections and replica.engine.has_unfinished():
            assert self._injector is not None and self.step_timeout is not None   # hangs need both
            at = max(now, replica.engine.clock()) + self.step_timeout
            self._detections[replica.index] = at
            self._injector.push(at, _DETECT, replica.index)

    def _kill(self, index: int, now: float, reason: str) -> None:
        """Replica ``index`` dies at ``now``: each request it held resumes on a live replica or ends with
        ``reason`` (``ClusterBase._recover``, as for a real actor); a restart is queued if any remain. What
        ended is reported by the next ``step`` with a model-free record of this replica."""
        replica = self.replicas[index]
        num_blocks = replica.engine.num_kv_blocks
        self._first_arrivals = None   # the coming routes skip it now
        self._unready(index)
        self._detections.pop(index, None)
        held, ended = replica.die()
        held += self._take_incoming(index)
        if replica.num_restarts < self.max_restarts:   # queued first: its own requests may wait for it
            replica.num_restarts += 1
            assert self._injector is not None   # a simulated death comes from it
            self._restart_at[index] = now + self.faults.restart_delay
            self._injector.push(self._restart_at[index], RESTART, index)
        ended += self._recover(replica, held, reason, now)
        self._reports.append(StepOutput(ended, death_record(index, now, num_blocks)))

    def _take_incoming(self, index: int) -> list[Request]:
        """Requests on their way to replica ``index`` (K/V in transit; a disaggregated cluster's), taken back."""
        return []


_DETECT = "detect"   # a hung replica's detection (no step within cluster.step_timeout)

