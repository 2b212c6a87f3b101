"""Where a run's records go: files always, Weights & Biases when asked, a progress bar for people watching.

A logger is a plugin like a policy: subclass ``RunLogger``, decorate it with ``@register_logger("name")`` and
choose it with ``logger=name``. The engine calls, in order::

    start(run_dir, config, group, name)  ->  log_step(step)* / log_request(record)*  ->  log_summary(...)  ->  finish()

Steps and requests are the plain records of ``nanovllm.serving.records`` (optionally annotated by the monitor), so a
logger never sees an engine object.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from nanovllm.registry import Registry
from nanovllm.serving.records import RunWriter, dumps


WandbMode = Literal["online", "offline", "disabled", "shared"]   # wandb.init(mode=...)


class RunLogger:
    """Base logger: every hook is a no-op, so a subclass overrides only what it cares about."""

    def start(self, run_dir: Path, config: dict, group: str | None = None, name: str | None = None) -> None:
        """Called once before the first step. ``run_dir`` exists; ``config`` is the run's resolved config."""

    def log_step(self, step: Mapping[str, Any]) -> None:
        """One engine step (a ``StepRecord``, maybe with monitor fields such as ``mfu``)."""

    def log_request(self, record: Mapping[str, Any]) -> None:
        """One finished (or failed) request (a ``RequestRecord``)."""

    def log_summary(self, summary: dict, breakdowns: dict[str, dict] | None = None) -> None:
        """The run's summary metrics, and optionally the same metrics broken down by a key (client, priority)."""

    def finish(self) -> None:
        """Called once at the end; release files and connections."""


LOGGERS: Registry[RunLogger] = Registry("logger", base=RunLogger, builtin_packages=("nanovllm.serving.loggers",))


def register_logger(name: str) -> Callable[[type[RunLogger]], type[RunLogger]]:
    """Class decorator registering a ``RunLogger`` subclass under ``name``."""
    return LOGGERS.register(name)


def configured_loggers(spec: Mapping[str, Any]) -> list[RunLogger]:
    """The configured logger (a checked ``{name, **options}``), plus the jsonl one whatever it is: a run's files
    are always written (``python -m nanovllm.serve`` and ``runner=http`` build theirs with this)."""
    loggers = [LOGGERS.build(dict(spec))]
    return loggers if isinstance(loggers[0], JsonlLogger) else [*loggers, JsonlLogger()]


# -- files ------------------------------------------------------------------------------------------------------


@register_logger("jsonl")
class JsonlLogger(RunLogger):
    """Files only: ``steps.jsonl`` and ``requests.jsonl`` streamed as records arrive (line-buffered, so a
    crashed or interrupted run keeps everything up to its last step), ``metrics.json`` at the summary, and
    ``config.json`` so the run's files are self-describing even without Hydra."""

    def __init__(self) -> None:
        self.writer: RunWriter | None = None

    @property
    def run_dir(self) -> Path | None:
        return self.writer.run_dir if self.writer is not None else None

    def start(self, run_dir: Path, config: dict, group: str | None = None, name: str | None = None) -> None:
        self.writer = RunWriter(run_dir, config)

    def log_step(self, step: Mapping[str, Any]) -> None:
        self._open().write_step(step)

    def log_request(self, record: Mapping[str, Any]) -> None:
        self._open().write_request(record)

    def log_summary(self, summary: dict, breakdowns: dict[str, dict] | None = None) -> None:
        self._open().write_metrics(summary, breakdowns)

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _open(self) -> RunWriter:
        if self.writer is None:
            raise RuntimeError("the jsonl logger was used before start()")
        return self.writer


# -- Weights & Biases -------------------------------------------------------------------------------------------


WANDB_MODES = ("online", "offline", "disabled", "shared")  # wandb.init's modes


@dataclass
class WandbLoggerConfig:
    """Arguments of the ``wandb`` logger. ``mode=None`` defers to ``WANDB_MODE`` (and wandb's own default);
    any other value wins over the environment, so runs stay offline unless someone asks for online."""

    project: str = "nanovllm"
    entity: str | None = None
    mode: WandbMode | None = "offline"
    group: str | None = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # wandb.init would only fail on a bad mode once the model has loaded and the run has started.
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(f"logger.mode must be one of {', '.join(WANDB_MODES)} or null, got {self.mode!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _numeric(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numeric fields: W&B charts numbers, and ``None`` / NaN would only add gaps and warnings.
    Nested mappings (a step's ``kv_tiers``: per tier counters) become ``kv_tiers/host/hit_tokens``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if _is_number(value):
            out[prefix + key] = value
        elif isinstance(value, Mapping):
            out.update(_numeric(value, f"{prefix}{key}/"))
    return out


def _request_row(record: Mapping[str, Any], columns: list[str]) -> list[Any]:
    return [record.get(column) for column in columns]


@register_logger("wandb")
class WandbLogger(JsonlLogger):
    """Everything the ``jsonl`` logger writes, plus a W&B run (offline by default): config, one history row
    per engine step, the summary, and a table of per-request records.

    Each logger owns its run (``reinit="create_new"``) and talks to it directly instead of through the global
    ``wandb.log``, so several runs in one process (sweeps, notebooks) neither collide nor leak into each other.
    """

    # Per-token timestamps would make the table huge; the count is already ``num_output_tokens``.
    dropped_request_columns = ("token_times",)

    def __init__(
        self,
        project: str = "nanovllm",
        entity: str | None = None,
        mode: WandbMode | None = "offline",
        group: str | None = None,
        tags: list[str] | tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.options = WandbLoggerConfig(project, entity, mode, group, list(tags))
        self.run: Any = None
        self._requests_seen: list[dict] = []

    def start(self, run_dir: Path, config: dict, group: str | None = None, name: str | None = None) -> None:
        super().start(run_dir, config, group, name)
        import wandb  # imported here: wandb is slow to import and only this logger needs it

        options = self.options
        self.run = wandb.init(
            project=options.project,
            entity=options.entity,
            mode=options.mode,  # None lets wandb read WANDB_MODE
            dir=str(run_dir),
            group=group or options.group,
            name=name,
            tags=options.tags or None,
            config=json.loads(dumps(config)),  # the same plain values config.json holds
            reinit="create_new",
            settings=_quiet_settings(wandb),
        )

    def log_step(self, step: Mapping[str, Any]) -> None:
        super().log_step(step)
        metrics = _numeric(step)
        metrics.pop("step", None)  # it is the x axis (``_step``), not a metric
        self.run.log(metrics, step=int(step["step"]))

    def log_request(self, record: Mapping[str, Any]) -> None:
        super().log_request(record)
        self._requests_seen.append(dict(record))

    def log_summary(self, summary: dict, breakdowns: dict[str, dict] | None = None) -> None:
        super().log_summary(summary, breakdowns)
        self.run.summary.update(summary)
        self.run.summary.update(_numeric({"kv_tiers": summary.get("kv_tiers") or {}}))   # flat, as the steps
        if breakdowns:
            self.run.summary["breakdowns"] = breakdowns
        if self._requests_seen:
            self.run.log({"requests": self._request_table()})

    def finish(self) -> None:
        super().finish()
        if self.run is not None:
            self.run.finish()
            self.run = None

    def _request_table(self) -> Any:
        import wandb

        columns = [key for key in self._requests_seen[0] if key not in self.dropped_request_columns]
        rows = [_request_row(record, columns) for record in self._requests_seen]
        return wandb.Table(columns=columns, data=rows)


def _quiet_settings(wandb: Any) -> Any:
    """No console output, no console capture (the progress bar would end up in the run), and none of the
    background system-metrics sampling and machine probing that cost a second per run (wandb >= 0.19 names)."""
    return wandb.Settings(
        silent=True,
        console="off",
        x_disable_stats=True,
        x_disable_meta=True,
        x_disable_machine_info=True,
    )
