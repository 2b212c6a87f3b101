"""The routing seam: which replica of a cluster serves each arriving request. A router is to the cluster what a
policy is to one engine: it ranks and chooses; the cluster enforces (it checks the answer, adds the request to
that replica and keeps every replica's state). The same ``Router`` classes run in the simulated cluster (many
replicas on one virtual clock) and in the real one (replicas as Ray actors).

A minimal router overrides ``route``::

    @register_router("fewest_waiting")
    class FewestWaiting(Router):
        def route(self, request, replicas, now):
            return min((r for r in replicas if r.alive), key=lambda r: r.num_waiting).index

then ``python -m nanovllm.run plugins=[my_router.py] runner=sim cluster.replicas=8 router.name=fewest_waiting``.

What the cluster calls, and when:

1. ``route(request, replicas, now)``: once per arriving request, at its arrival time, before any replica has
   seen it. ``replicas`` holds one read-only ``ReplicaView`` per replica, in replica order (``view.index`` is
   its position), dead ones included (``alive`` False; routing to one is an error). Returns the index.
2. ``on_arrival(request, replica, now)``: right after the request joined the chosen replica.
3. ``on_finish(request, replica, now)``: when the request ended there (finished, failed or aborted).

``bind_step_time`` gives a router that predicts latency the cluster's step-time estimate (the simulator's
step-time model for simulated replicas, this machine's calibrated profile for real ones).
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Mapping, Sequence

from nanovllm.registry import Registry
from nanovllm.request import Request

StepTimeEstimate = Callable[[Mapping[str, int]], float]   # batch features (StepRecord keys) -> seconds


class RouterError(RuntimeError):
    """A router raised, or returned something the cluster cannot use (not an index of a live replica)."""


class ReplicaView:
    """What a router may know of one replica when a request arrives: queue lengths, KV memory, tokens queued,
    recent latencies and how much of this request its prefix cache holds. Read-only; a router must not keep a
    view past the ``route`` call it was given in (the next call gets fresh ones).

    ``prefix_match_tokens`` is computed on first access (a prefix-cache lookup that takes no reference and
    changes no recency), so routers that never read it cost nothing per replica. (The cluster reuses a
    replica's view from one arrival to the next while the replica has not changed, binding each new request
    to it: that keeps routing O(replicas) per request, whatever the queues hold.)
    """

    __slots__ = ("index", "alive", "num_running", "num_waiting", "num_free_blocks", "num_total_blocks",
                 "block_size", "num_queued_tokens", "num_decoding", "max_num_seqs", "max_num_batched_tokens",
                 "recent_ttft", "recent_itl", "num_routed", "_prefix_lookup", "_request", "_prefix_match")

    def __init__(self, *, index: int, alive: bool, num_running: int, num_waiting: int, num_free_blocks: int,
                 num_total_blocks: int, block_size: int, num_queued_tokens: int, num_decoding: int,
                 max_num_seqs: int, max_num_batched_tokens: int, recent_ttft: float | None,
                 recent_itl: float | None, num_routed: int,
                 prefix_lookup: Callable[[Request], int] | None = None) -> None:
        self.index = index                          # its position in the cluster (what ``route`` returns)
        self.alive = alive                          # False: the replica died; routing to it is an error
        self.num_running = num_running              # requests holding KV blocks
        self.num_waiting = num_waiting              # requests queued (preempted ones included)
        self.num_free_blocks = num_free_blocks      # KV blocks free (cached-but-free prefix blocks included)
        self.num_total_blocks = num_total_blocks
        self.block_size = block_size                # tokens per KV block
        self.num_queued_tokens = num_queued_tokens  # tokens of its unfinished requests not computed yet
        self.num_decoding = num_decoding            # running requests past their prompt
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.recent_ttft = recent_ttft              # mean TTFT (s) of its last finished requests; None: none yet
        self.recent_itl = recent_itl                # mean inter-token latency (s) of the same requests
        self.num_routed = num_routed                # requests routed to it so far
        self._prefix_lookup = prefix_lookup
        self._request: Request | None = None
        self._prefix_match: int | None = None

    def bind(self, request: Request) -> "ReplicaView":
        """This view for routing ``request`` (the cluster calls it; the prefix match is looked up anew)."""
        self._request, self._prefix_match = request, None
        return self

    @property
    def num_outstanding(self) -> int:
        """Requests sent to it and not yet ended: running plus waiting."""
        return self.num_running + self.num_waiting

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def prefix_match_tokens(self) -> int:
        """How many leading tokens of the request being routed this replica's prefix cache holds now (0 for an
        allocator without a prefix cache, and for a dead replica), its KV tiers included (a ``CachedPrefix``
        where the replica has tiers: ``prefix_match_by_tier`` splits it)."""
        if self._prefix_match is None:
            lookup, request = self._prefix_lookup, self._request
            self._prefix_match = lookup(request) if lookup is not None and request is not None and self.alive else 0
        return self._prefix_match

    @property
    def prefix_match_by_tier(self) -> dict[str, int]:
        """``prefix_match_tokens`` split by where the blocks are: ``primary`` (the replica's pool), then each KV
        tier below it by name (``host``, ``disk``, ``shared``: docs/kv_tiers.md); ``{"primary": n}`` for a
        replica without tiers."""
        match = self.prefix_match_tokens
        by_tier = getattr(match, "by_tier", None)
        return dict(by_tier) if by_tier is not None else {"primary": int(match)}

    @property
    def prefix_match_local_tokens(self) -> int:
        """The part of the match only this replica has: all of it but what the cluster's ``shared`` store holds
        (which any replica would load just as well)."""
        return int(self.prefix_match_tokens) - self.prefix_match_by_tier.get("shared", 0)

    def __repr__(self) -> str:
        return (f"ReplicaView(index={self.index}, alive={self.alive}, running={self.num_running}, "
                f"waiting={self.num_waiting}, free_blocks={self.num_free_blocks}/{self.num_total_blocks}, "
                f"queued_tokens={self.num_queued_tokens})")


class Router(abc.ABC):
    """Base router. Subclasses implement ``route``; the callbacks are for routers that keep state (counters,
    a hash ring, an approximate cache map). See the module docstring for when each is called."""

    registered_name: str = "custom"
    _step_time: StepTimeEstimate | None = None

    @abc.abstractmethod
    def route(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        """The index of the replica that serves ``request`` (arrived at ``now``); must be a live one."""

    def on_arrival(self, request: Request, replica: int, now: float) -> None:
        """``request`` joined replica ``replica`` (the one ``route`` chose)."""

    def on_finish(self, request: Request, replica: int, now: float) -> None:
        """``request`` ended on replica ``replica`` (finished, failed or aborted)."""

    def upcoming_routes(self, count: int, num_replicas: int) -> list[int] | None:
        """The replicas the next ``count`` requests will be routed to, in order, when every replica is alive and
        the choice depends on nothing but the requests' order; None (the default) when it reads the replicas'
        views. A simulated cluster then lets each replica run ahead until the first request that can reach it
        (``Cluster._replica_horizon``). Asked between steps; must not change the router's state."""
        return None

    def bind_step_time(self, estimate: StepTimeEstimate) -> None:
        """Called by the cluster before the first request with its step-time estimate (batch features ->
        seconds), for routers that predict latency."""
        self._step_time = estimate

    @property
    def step_time(self) -> StepTimeEstimate | None:
        return self._step_time


def live_replicas(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The views of live replicas; RouterError when none is left (nothing can serve the request)."""
    alive = [view for view in replicas if view.alive]
    if not alive:
        raise RouterError("no live replica is left to route to")
    return alive


ROUTERS: Registry[Router] = Registry("router", base=Router, builtin_packages=("routers",))


def register_router(name: str) -> Callable[[type[Router]], type[Router]]:
    """Class decorator registering a ``Router`` subclass under ``name`` (``router.name=<name>``)."""
    return ROUTERS.register(name)


def check_route(router: Router, choice: Any, replicas: Sequence[ReplicaView]) -> int:
    """``choice`` as a replica index, or RouterError naming the router and what was wrong with it."""
    if not isinstance(choice, int) or isinstance(choice, bool) or not 0 <= choice < len(replicas):
        raise RouterError(f"router {router.registered_name!r}: route() must return a replica index in "
                          f"[0, {len(replicas)}), got {choice!r}")
    if not replicas[choice].alive:
        raise RouterError(f"router {router.registered_name!r}: route() chose replica {choice}, which is dead")
    return choice
