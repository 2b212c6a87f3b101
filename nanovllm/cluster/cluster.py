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
import threading
from typing import Any, Sequence

from nanovllm.cluster.replica import LocalReplica
from nanovllm.engine.engine import LLMEngine
from nanovllm.engine.protocol import EngineClient, StepOutput
from nanovllm.request import Request
from nanovllm.router import Router, RouterError, StepTimeEstimate, check_route
from nanovllm.sampling import SamplingParams


class ClusterClock:
    """The serving loop's clock over a cluster of virtual-clock replicas (see the module docstring)."""

    def __init__(self, cluster: "Cluster") -> None:
        self._cluster = cluster
        self._idle_time = 0.0   # where time stands while no replica has work

    def now(self) -> float:
        busy = self._cluster.next_ready_time()
        return self._idle_time if busy is None else busy

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
        loads = [view.num_outstanding for view in views if view.alive]
        total = sum(loads)
        imbalance.append(max(loads) * len(loads) / total if total else 1.0)

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

    def __init__(self, engines: Sequence[LLMEngine], router: Router,
                 step_time: StepTimeEstimate | None = None) -> None:
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

    # -- requests ------------------------------------------------------------------------------------------------
    def add_request(self, request: Request, error: str | None = None) -> None:
        """Route ``request`` at its arrival time and queue it on the chosen replica (a refused one, with
        ``error``, is routed too and ends failed there at its next step)."""
        now = request.arrival_time
        index = self._route(request, now)
        replica = self.replicas[index]
        request.replica = index
        if not replica.has_unfinished():
            replica.wake(now)
        replica.add(request, error=error)
        self._ask("on_arrival", request, index, now)
        self._mark_ready(index)

    def has_unfinished(self) -> bool:
        return bool(self._ready)

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) requests over every replica."""
        lengths = [engine.queue_lengths() for engine in self.engines]
        return sum(r for r, _ in lengths), sum(w for _, w in lengths)

    def abort_request(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort ``request_id`` on the replica that holds it (its next step reports it); False if none does."""
        for replica in self.replicas:
            if replica.holds(request_id):
                return replica.engine.abort_request(request_id, reason)
        return False

    def abort_all(self, reason: str = "aborted") -> list[str]:
        """Abort every request on every replica (each replica reports them at its next ``step``)."""
        ids: list[str] = []
        for replica in self.replicas:
            ids += replica.engine.abort_all(reason)
        return ids

    # -- the step ------------------------------------------------------------------------------------------------
    def next_ready_time(self) -> float | None:
        """When the next step starts: the earliest clock among replicas with work (None: none has work)."""
        return self._ready[0][0] if self._ready else None

    def step(self) -> StepOutput:
        """Run one step of the replica whose clock is earliest; its record says which replica (``replica``)."""
        _, index = heapq.heappop(self._ready)
        self._in_ready[index] = False
        replica = self.replicas[index]
        output = replica.step()
        output.record["replica"] = index
        self._stepped(replica, output, replica.engine.clock())
        self._mark_ready(index)
        return output

    def _stepped(self, replica: LocalReplica, output: StepOutput, now: float) -> None:
        """After ``replica``'s step: the router hears of the requests that ended there."""
        for request in output.finished:
            self._ask("on_finish", request, replica.view_index, now)

    # -- helpers ---------------------------------------------------------------------------------------------
    def _route(self, request: Request, now: float) -> int:
        """The router's choice for ``request`` among the replicas' views, checked (RouterError otherwise)."""
        return self._choose(request, [replica.view(request, now) for replica in self.replicas], now)

    def _mark_ready(self, index: int) -> None:
        replica = self.replicas[index]
        if not self._in_ready[index] and replica.has_unfinished():
            heapq.heappush(self._ready, (replica.engine.clock(), index))
            self._in_ready[index] = True

