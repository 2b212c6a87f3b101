"""The number a tuning sweep optimizes: one metric of the run's summary (``metrics.json``), and its direction.

``python -m nanovllm.run`` returns it from its task function, which is what Hydra sweepers that search
(``hydra/sweeper=optuna``) read. ``objective.metric`` is any numeric key of the summary, e.g.
``output_throughput`` (tok/s), ``request_goodput`` (req/s meeting ``slo.*``), ``p99_ttft_ms``;
``objective.direction`` is ``maximize`` or ``minimize`` and must agree with the sweeper's own direction
(``hydra/sweeper=tune`` sets it from ``objective.direction``). A job that failed returns None, which Optuna
records as a failed trial; ``tune`` tolerates failed trials (``max_failure_rate: 1.0``), so the study goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

DIRECTIONS = ("maximize", "minimize")


@dataclass
class ObjectiveConfig:
    metric: str = "output_throughput"   # a numeric key of metrics.json
    direction: str = "maximize"         # maximize | minimize

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"objective.direction must be one of {', '.join(DIRECTIONS)}, got {self.direction!r}")


def check_sweeper_direction(objective: ObjectiveConfig, sweeper: Mapping[str, Any]) -> None:
    """A sweeper that optimizes (it has a ``direction``) must optimize the way ``objective.direction`` says."""
    direction = sweeper.get("direction")
    if direction is None:
        return
    name = getattr(direction, "name", str(direction))
    if name != objective.direction:
        raise ValueError(
            f"objective.direction={objective.direction} but hydra.sweeper.direction={name}: the sweeper would "
            f"{name} {objective.metric}; add hydra.sweeper.direction={objective.direction} "
            f"(or use hydra/sweeper=tune, which follows objective.direction)"
        )


def objective_value(summary: Mapping[str, Any], objective: ObjectiveConfig) -> float:
    """The objective metric of a finished run's summary, as a float."""
    if objective.metric not in summary:
        numeric = sorted(k for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        raise ValueError(f"objective.metric {objective.metric!r} is not in the run's metrics; numeric ones: "
                         f"{', '.join(numeric)}")
    value = summary[objective.metric]
    if value is None:
        raise ValueError(f"objective.metric {objective.metric!r} has no value in this run"
                         + (" (goodput needs SLO targets: set slo.ttft_ms, slo.tpot_ms or slo.e2el_ms)"
                            if "goodput" in objective.metric else ""))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"objective.metric {objective.metric!r} is not numeric (got {value!r})")
    return float(value)
