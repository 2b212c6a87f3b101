"""The ``runner`` config node (``conf/runner/``) of ``python -m nanovllm.run``: checked before anything loads
(``check_runner``), then turned into the ``ServedEngine`` the run serves through (``served_engine``).

Which runners exist is the engine's registry (``nanovllm.engine.runner.RUNNERS``: ``real``, ``tp``, ``sim``, and
any a plugin registers), plus the client runners (``CLIENT_RUNNERS``: ``http``), which build no engine at all
and send the workload to a server instead (``nanovllm.harness.http_client``). A runner's options are its constructor's; the simulator's are the keys of
``conf/runner/sim.yaml`` (the step-time model and its inputs), from which the harness builds what the simulated
runner is given (a step-time model, output lengths).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Mapping

from nanovllm.cluster.config import ClusterConfig
from nanovllm.config import EngineConfig
from nanovllm.engine.engine import PluginSpec
from nanovllm.engine.runner import RUNNERS
from nanovllm.harness.cluster import ServedCluster
from nanovllm.harness.serving import ServedEngine
from nanovllm.harness.sim.hardware import Hardware
from nanovllm.harness.sim.simulate import SIM_RUNNER_KEYS, Simulation
from nanovllm.harness.sim.step_time import STEP_TIME_MODELS

SIM = "sim"
# Runners that drive a server, not an engine: the workload goes over the network and the figures are the
# client's (runner=http: any OpenAI-compatible server, ours or another engine's).
HTTP = "http"
CLIENT_RUNNERS = (HTTP,)


def runner_names() -> list[str]:
    """Every name ``runner.name`` accepts: the engine's registered runners and the client runners."""
    return sorted({*RUNNERS.names(), *CLIENT_RUNNERS})


def check_runner(runner: Mapping[str, Any], hardware: Mapping[str, Any] | None) -> None:
    """Validate the ``runner`` (and ``hardware``) config nodes before anything loads; errors name the field."""
    name = runner.get("name")
    if not isinstance(name, str) or name not in runner_names():
        raise ValueError(f"runner.name must be one of {', '.join(runner_names())}, got {name!r}")
    if name == HTTP:
        from nanovllm.harness.http_client import HttpRunnerConfig  # httpx only where it is used

        try:
            HttpRunnerConfig(**runner)
        except TypeError as exc:  # an unknown key: the dataclass's own message names it
            raise ValueError(f"runner: {exc} (runner=http; allowed: "
                             f"{', '.join(HttpRunnerConfig.__dataclass_fields__)})") from None
        return
    allowed = SIM_RUNNER_KEYS if name == SIM else ("name", *_constructor_options(RUNNERS.get(name)))
    unknown = sorted(set(runner) - set(allowed))
    if unknown:
        raise ValueError(f"runner: unknown key(s) {', '.join(unknown)} for runner={name}; allowed: "
                         f"{', '.join(allowed)}")
    if name == SIM:
        _check_simulation(runner, hardware)


def _constructor_options(cls: type) -> list[str]:
    """The options a runner takes from its config: its constructor's named parameters after the context."""
    parameters = list(inspect.signature(cls).parameters.values())[len(RUNNERS.engine_args):]
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _check_simulation(runner: Mapping[str, Any], hardware: Mapping[str, Any] | None) -> None:
    step_time = runner.get("step_time")
    try:
        STEP_TIME_MODELS.get(str(step_time))
    except KeyError as exc:
        raise ValueError(f"runner.step_time: {exc}") from None
    for key in ("profile", "replay_run", "output_lengths_from"):
        # Found now, not after the engine is built: each names a file or run directory to read.
        value = runner.get(key)
        if value is not None and not Path(str(value)).expanduser().exists():
            raise ValueError(f"runner.{key}={value!r}: no such file or directory (cwd: {Path.cwd()})")
    if step_time == "analytical" or hardware is not None:
        Hardware.from_config(hardware)


def served_engine(runner: Mapping[str, Any], hardware: Mapping[str, Any] | None, config: EngineConfig,
                  cluster: ClusterConfig | None = None, router: PluginSpec = "round_robin",
                  plugin_paths: Any = (), **plugins: PluginSpec) -> ServedEngine:
    """The engine the (checked) ``runner`` node asks for, with its clock and cost model: the simulator gets its
    step-time model and virtual clock (``Simulation.from_config``); any other runner is the engine's own, on
    the wall clock, its options passed through. With ``cluster.replicas`` > 1 (simulated), that many replicas
    behind ``router`` (``nanovllm.harness.cluster.ServedCluster``); with runner ``real``, that many engines in Ray
    actors (``plugin_paths``: the files they import first, as this process did)."""
    if cluster is not None and cluster.replicas > 1:
        if runner["name"] == SIM:
            return ServedCluster.simulated(cluster, router, runner, hardware, config, **plugins)
        return ServedCluster.real(cluster, router, config, plugin_paths=plugin_paths, **plugins)
    if runner["name"] == SIM:
        return Simulation.from_config(runner, hardware, config, **plugins)
    return ServedEngine.build(config, dict(runner), **plugins)
