"""Faults injected into a simulated cluster (``cluster.faults``) and what every cluster shares to recover from them.

``FaultsConfig`` is the ``cluster.faults`` node: replica deaths at given times (``deaths``) or at a rate (a Poisson
process per replica, seeded), replica hangs at given times (``hangs``: the replica stops stepping and holds its
requests until ``cluster.step_timeout`` declares it dead), how long a dead replica takes to come back
(``restart_delay``, when ``cluster.max_restarts`` allows it) and the probability that a prefill/decode K/V transfer
fails (``kv_transfer_failure``: the decode replica then recomputes the prompt).

``FaultInjector`` turns it into a time-ordered stream of events for ``nanovllm.cluster.cluster.Cluster``; the
recovery itself (a dead replica's requests resumed elsewhere or ended with the reason) is ``ClusterBase``'s, the
same code ``RayCluster`` runs when a real actor dies.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Mapping

from nanovllm.outputs import StepRecord

DEATH, HANG, RESTART = "death", "hang", "restart"


@dataclass
class FaultsConfig:
    """``deaths``: ``[{replica: i, time: s}, ...]``, replica ``i`` dies ``s`` seconds into the run (simulated
    time). ``rate``: deaths per replica per hour, each replica's a Poisson process of its own drawn from ``seed``
    (a death that falls while the replica is already dead is void). ``hangs``: ``[{replica, time}]``, the replica
    stops stepping at ``time`` (found dead ``cluster.step_timeout`` seconds after its last step).
    ``restart_delay``: seconds from a death to the replica serving again, empty cache (``cluster.max_restarts``
    bounds how often). ``kv_transfer_failure``: probability that a prefill/decode hand-off's K/V transfer fails
    (drawn from ``seed``); the decode replica then computes the prompt itself."""

    deaths: Any = field(default_factory=list)
    rate: float = 0.0
    hangs: Any = field(default_factory=list)
    seed: int = 0
    restart_delay: float = 30.0
    kv_transfer_failure: float = 0.0

    def __post_init__(self) -> None:
        self.deaths = _events("deaths", self.deaths)
        self.hangs = _events("hangs", self.hangs)
        for name in ("rate", "restart_delay"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0 or math.isinf(value):
                raise ValueError(f"cluster.faults.{name} must be a number >= 0, got {value!r}")
        if not _is_number(self.kv_transfer_failure) or not 0.0 <= self.kv_transfer_failure <= 1.0:
            raise ValueError("cluster.faults.kv_transfer_failure must be a probability in [0, 1], got "
                             f"{self.kv_transfer_failure!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"cluster.faults.seed must be an integer, got {self.seed!r}")

    @classmethod
    def from_spec(cls, spec: Any) -> "FaultsConfig":
        """From the ``cluster.faults`` node (a mapping, None or an instance); unknown keys are named."""
        if isinstance(spec, FaultsConfig):
            return spec
        if spec is None:
            return cls()
        if not isinstance(spec, Mapping):
            raise ValueError(f"cluster.faults must map fault settings to values, got {spec!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"cluster.faults: unknown key(s) {', '.join(map(str, unknown))} (known: "
                             f"{', '.join(sorted(known))})")
        return cls(**dict(spec))

    @property
    def active(self) -> bool:
        """Whether any fault is injected."""
        return bool(self.deaths or self.hangs or self.rate or self.kv_transfer_failure)

    def check_replicas(self, replicas: int) -> None:
        """Every replica named by ``deaths`` / ``hangs`` exists (``ValueError`` naming the first that does not)."""
        for name in ("deaths", "hangs"):
            for replica, _ in getattr(self, name):
                if not 0 <= replica < replicas:
                    raise ValueError(f"cluster.faults.{name}: replica {replica} is not in [0, {replicas})")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _events(name: str, spec: Any) -> list[tuple[int, float]]:
    """``[{replica, time}, ...]`` as sorted (replica, time) pairs, each checked."""
    if spec is None:
        return []
    if isinstance(spec, (str, bytes)) or not hasattr(spec, "__iter__"):
        raise ValueError(f"cluster.faults.{name} must be a list of {{replica: i, time: seconds}}, got {spec!r}")
    events = []
    for item in spec:
        if not isinstance(item, Mapping) or set(item) != {"replica", "time"}:
            raise ValueError(f"cluster.faults.{name}: each entry is {{replica: i, time: seconds}}, got {item!r}")
        replica, time = item["replica"], item["time"]
        if not isinstance(replica, int) or isinstance(replica, bool) or replica < 0:
            raise ValueError(f"cluster.faults.{name}: replica must be an integer >= 0, got {replica!r}")
        if not _is_number(time) or time < 0:
            raise ValueError(f"cluster.faults.{name}: time must be seconds >= 0, got {time!r}")
        events.append((replica, float(time)))
    return sorted(events, key=lambda event: (event[1], event[0]))


class FaultInjector:
    """The fault events of one simulated run, in time order: ``(time, kind, replica)`` with kind ``death``,
    ``hang`` or ``restart``. Times are the run's seconds offset by ``t0`` (the cluster's clock at the start).

    Each replica's Poisson deaths come from a random stream of its own (seeded with ``seed`` and the replica),
    so the same seed gives the same deaths whatever else happens in the run; transfer failures come from one
    more stream, drawn once per hand-off in the order hand-offs happen."""

    def __init__(self, config: FaultsConfig, replicas: int, t0: float = 0.0) -> None:
        config.check_replicas(replicas)
        self.config = config
        self._order = itertools.count()
        self._events: list[tuple[float, int, str, int]] = []
        for replica, time in config.deaths:
            self.push(t0 + time, DEATH, replica)
        for replica, time in config.hangs:
            self.push(t0 + time, HANG, replica)
        self._rate_per_s = config.rate / 3600.0
        self._streams = [random.Random(config.seed * 1_000_003 + replica) for replica in range(replicas)]
        self._poisson: set[int] = set()   # event orders that are Poisson deaths (each draws the next)
        if self._rate_per_s > 0:
            for replica in range(replicas):
                self._push_poisson(t0, replica)
        self._transfers = random.Random(config.seed * 1_000_003 - 1)

    def push(self, time: float, kind: str, replica: int) -> int:
        """Queue an event (a restart, say); returns its order."""
        order = next(self._order)
        heapq.heappush(self._events, (time, order, kind, replica))
        return order

    def _push_poisson(self, after: float, replica: int) -> None:
        self._poisson.add(self.push(after + self._streams[replica].expovariate(self._rate_per_s), DEATH, replica))

    def next_time(self) -> float | None:
        """When the next event happens (None: none is queued)."""
        return self._events[0][0] if self._events else None

    def pop_due(self, until: float) -> tuple[float, str, int] | None:
        """The next event at or before ``until``, removed (a Poisson death queues that replica's next one)."""
        if not self._events or self._events[0][0] > until:
            return None
        time, order, kind, replica = heapq.heappop(self._events)
        if order in self._poisson:
            self._poisson.discard(order)
            self._push_poisson(time, replica)
        return time, kind, replica

    def transfer_fails(self) -> bool:
        """Whether the next K/V transfer fails (a draw, only when a failure probability is set)."""
        p = self.config.kv_transfer_failure
        return p > 0 and self._transfers.random() < p


def death_record(replica: int, now: float, num_total_blocks: int) -> StepRecord:
    """The model-free step record that reports what a replica's death ended (its requests that failed or were
    aborted): no tokens, no time, the replica's whole cache free (``steps.jsonl`` shows when it died)."""
    record = StepRecord(
        step=0, start_time=now, duration=0.0, num_prefill_tokens=0, num_decode_tokens=0, num_prefill_seqs=0,
        num_decode_seqs=0, num_running=0, num_waiting=0, num_preempted=0, kv_blocks_used=0,
        kv_blocks_cached=0, kv_blocks_free=num_total_blocks, kv_blocks_total=num_total_blocks,
        context_tokens=0, attn_pairs=0, num_sampled=0, prefix_hit_tokens=0, recomputed_tokens=0,
        num_evictions=0, kv_slots_unused=0, spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0,
        spec_decode_num_accepted_tokens=0)
    record["replica"] = replica
    return record


__all__ = ["FaultsConfig", "FaultInjector", "death_record"]
