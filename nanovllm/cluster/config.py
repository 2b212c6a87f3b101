"""``ClusterConfig``: how many replicas, how each may differ, and where real replicas run (the ``cluster``
config node of ``python -m nanovllm.run``; a plain dataclass, so it doubles as the Hydra schema)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from nanovllm.cluster.faults import FaultsConfig
from nanovllm.config import EngineConfig


@dataclass
class ClusterConfig:
    """``replicas``: engine replicas behind the router (1: one engine, no router). ``replica_overrides``:
    ``{replica index: {engine field: value}}``, e.g. ``{0: {num_kv_blocks: 64}}`` for a replica with a smaller
    cache; the others take the run's ``engine`` settings. ``address``: the Ray cluster real replicas join
    (null: a local instance started and stopped with the run; ``auto``: the running one).

    ``prefill_replicas`` and ``decode_replicas`` (both >= 1, or both 0): prefill/decode disaggregation
    (``nanovllm.cluster.disaggregated``): the first ``prefill_replicas`` replicas prefill each request and
    sample its first token, the other ``decode_replicas`` decode it, its K/V moved between them by
    ``kv_transfer`` (a registered ``KVTransfer``: a name or ``{name, **options}``); ``replicas`` is then their
    sum (leave it 1, or give the sum).

    Faults (real replicas, ``RayCluster``): a replica that dies has each request it held resumed on a live
    replica of its pool (its prompt and generated tokens recomputed there), at most ``max_retries`` times per
    request (0: a dead replica's requests fail, as they did before retries); ``max_restarts``: how many times a
    dead replica's actor is relaunched (same index and settings; it rejoins the router once it answers), per
    replica (0: never). ``step_timeout``: seconds a replica with work may go without a step before it is treated
    as dead (a hang; null: never). ``faults``: faults injected into a simulated cluster (``runner=sim``; a
    ``FaultsConfig``: replica deaths at times or at a rate, hangs, restart delay, K/V transfer failures),
    recovered by the same code as a real replica's death."""

    replicas: int = 1
    replica_overrides: Any = field(default_factory=dict)
    address: str | None = None
    prefill_replicas: int = 0
    decode_replicas: int = 0
    kv_transfer: Any = "shared_memory"
    max_retries: int = 3
    max_restarts: int = 0
    step_timeout: float | None = None
    faults: Any = field(default_factory=dict)

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    def __post_init__(self) -> None:
        for name in ("prefill_replicas", "decode_replicas", "max_retries", "max_restarts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"cluster.{name} must be an integer >= 0, got {value!r}")
        if self.step_timeout is not None and (isinstance(self.step_timeout, bool) or not isinstance(
                self.step_timeout, (int, float)) or not self.step_timeout > 0):
            raise ValueError(f"cluster.step_timeout must be seconds > 0 or null, got {self.step_timeout!r}")
        self.faults = FaultsConfig.from_spec(self.faults)
        if self.faults.hangs and self.step_timeout is None:
            raise ValueError("cluster.faults.hangs need cluster.step_timeout: a hung replica is found dead only "
                             "when it has not stepped for that long")
        if (self.prefill_replicas > 0) != (self.decode_replicas > 0):
            raise ValueError("prefill/decode disaggregation needs both pools: cluster.prefill_replicas and "
                             f"cluster.decode_replicas >= 1 (got {self.prefill_replicas} and "
                             f"{self.decode_replicas}); set both, or neither for colocated replicas")
        if self.disaggregated:
            total = self.prefill_replicas + self.decode_replicas
            if self.replicas not in (1, total):
                raise ValueError(f"cluster.replicas={self.replicas} contradicts cluster.prefill_replicas + "
                                 f"cluster.decode_replicas = {total}; leave cluster.replicas unset")
            self.replicas = total
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 1:
            raise ValueError(f"cluster.replicas must be an integer >= 1, got {self.replicas!r}")
        if self.replica_overrides is None:
            self.replica_overrides = {}
        if not isinstance(self.replica_overrides, Mapping):
            raise ValueError("cluster.replica_overrides must map a replica index to engine settings, e.g. "
                             f"{{0: {{num_kv_blocks: 64}}}}, got {self.replica_overrides!r}")
        fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        overrides: dict[int, dict[str, Any]] = {}
        for key, settings in self.replica_overrides.items():
            try:
                index = int(key)
            except (TypeError, ValueError):
                index = -1
            if not 0 <= index < self.replicas:
                raise ValueError(f"cluster.replica_overrides: {key!r} is not a replica index in "
                                 f"[0, {self.replicas}) (cluster.replicas={self.replicas})")
            if not isinstance(settings, Mapping):
                raise ValueError(f"cluster.replica_overrides.{key} must map engine fields to values, got "
                                 f"{settings!r}")
            unknown = sorted(set(settings) - fields)
            if unknown:
                raise ValueError(f"cluster.replica_overrides.{key}: unknown engine field(s) {', '.join(unknown)}")
            overrides[index] = dict(settings)
        self.replica_overrides = overrides
        self.faults.check_replicas(self.replicas)

    def engine_config(self, base: EngineConfig, index: int) -> EngineConfig:
        """Replica ``index``'s engine settings: ``base`` with its overrides (validated as ``EngineConfig``)."""
        overrides = self.replica_overrides.get(index)
        if not overrides:
            return base
        try:
            return dataclasses.replace(base, **overrides)
        except ValueError as exc:
            raise ValueError(f"cluster.replica_overrides.{index}.{exc}") from exc
