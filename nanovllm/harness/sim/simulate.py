"""A simulated run: the real engine (scheduler, policy, allocator) on a ``SimulatedRunner`` and a virtual
clock, served by the same loop as a real run (``nanovllm.harness.serving.serve``), so it writes the same
records and files. From Python::

    sim = Simulation.build(EngineConfig(num_kv_blocks=512), "calibrated", scheduler="priority")
    result = sim.serve(generate_workload(SyntheticWorkloadConfig(num_requests=10_000, request_rate=20),
                                         sim.engine.tokenizer))

``python -m nanovllm.run runner=sim`` builds the same thing from the Hydra config (``Simulation.from_config``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from nanovllm.config import EngineConfig, torch_dtype
from nanovllm.engine.engine import LLMEngine, PluginSpec
from nanovllm.engine.sim_runner import VirtualClock, simulated_engine
from nanovllm.harness.monitor import ModelCost, MonitorConfig
from nanovllm.harness.records import read_run
from nanovllm.harness.serving import RunResult, serve
from nanovllm.harness.sim.hardware import Hardware
from nanovllm.harness.sim.step_time import STEP_TIME_MODELS, CalibratedStepTime, StepTimeModel
from nanovllm.request import Request

RUNNER_NAMES = ("real", "sim")
SIM_RUNNER_KEYS = ("name", "step_time", "profile", "replay_run", "output_lengths_from")  # conf/runner/sim.yaml


def check_runner(runner: Mapping[str, Any], hardware: Mapping[str, Any] | None) -> None:
    """Validate the ``runner`` (and ``hardware``) config nodes before anything loads; errors name the field."""
    name = runner.get("name")
    if name not in RUNNER_NAMES:
        raise ValueError(f"runner.name must be one of {', '.join(RUNNER_NAMES)}, got {name!r}")
    allowed = SIM_RUNNER_KEYS if name == "sim" else ("name",)
    unknown = sorted(set(runner) - set(allowed))
    if unknown:
        raise ValueError(f"runner: unknown key(s) {', '.join(unknown)} for runner={name}; allowed: "
                         f"{', '.join(allowed)}")
    if name == "real":
        return
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


def output_lengths_of(run_dir: str | Path) -> dict[str, int]:
    """request_id -> output tokens of a recorded run (the targets a simulation of that run stops at)."""
    return {r["request_id"]: r["num_output_tokens"] for r in read_run(run_dir, missing_ok=False).requests}


@dataclass
class Simulation:
    """A simulated engine, its virtual clock and its step-time model, ready to ``serve`` a workload."""

    engine: LLMEngine
    clock: VirtualClock
    model: StepTimeModel
    cost: ModelCost
    hardware: Hardware | None = None

    @classmethod
    def build(cls, config: EngineConfig, step_time: str, *, scheduler: PluginSpec = "fcfs",
              allocator: PluginSpec = "paged", attention: PluginSpec = "torch", profile: str | None = None,
              replay_run: str | None = None, hardware: Hardware | None = None,
              output_lengths: Mapping[str, int] | None = None) -> "Simulation":
        """Build the engine around the step-time model named ``step_time``. ``output_lengths``: request_id ->
        target output length (others stop at ``max_tokens``); a replay takes them from its run by default.
        With ``hardware`` and no ``num_kv_blocks``/``kv_cache_memory``, the KV cache gets the memory the
        weights leave (an error naming ``hardware.memory_bytes`` when they do not fit). A ``calibrated`` profile
        measured on another machine says so in one warning, logged (``machine_warning``)."""
        from transformers import AutoConfig

        from nanovllm.models.loader import resolve_model

        hf_config = AutoConfig.from_pretrained(resolve_model(config.model))
        cost = ModelCost.from_hf_config(hf_config, torch_dtype(config.dtype))
        if hardware is not None:
            kv_bytes = hardware.kv_cache_bytes(cost.total_params * cost.bytes_per_element)
            if config.num_kv_blocks is None and config.kv_cache_memory is None:
                config = dataclasses.replace(config, kv_cache_memory=kv_bytes)
        model = STEP_TIME_MODELS.build({"name": step_time, "profile": profile, "run": replay_run, "cost": cost,
                                        "hardware": hardware, "dtype": config.dtype, "model": config.model})
        warning = model.machine_warning() if isinstance(model, CalibratedStepTime) else None
        if warning:
            logging.getLogger(__name__).warning(warning)
        if output_lengths is None and replay_run:
            output_lengths = output_lengths_of(replay_run)
        clock = VirtualClock()
        engine = simulated_engine(config, lambda features: model.predict(features, clock.time),
                                  scheduler=scheduler, allocator=allocator, attention=attention,
                                  target_len=_target_len(output_lengths), clock=clock)
        return cls(engine, clock, model, cost, hardware)

    @classmethod
    def from_config(cls, runner: Mapping[str, Any], hardware: Mapping[str, Any] | None, config: EngineConfig,
                    **plugins: PluginSpec) -> "Simulation":
        """From the Hydra ``runner`` and ``hardware`` nodes (already checked by ``check_runner``)."""
        lengths_run = runner.get("output_lengths_from")
        return cls.build(
            config, str(runner["step_time"]), profile=runner.get("profile"), replay_run=runner.get("replay_run"),
            hardware=Hardware.from_config(hardware) if hardware is not None else None,
            output_lengths=output_lengths_of(lengths_run) if lengths_run else None, **plugins,
        )

    @property
    def annotations(self) -> dict[str, Any]:
        """What ``metrics.json`` gains: that the run was simulated, and with which step-time model."""
        return {"simulated": True, "step_time_model": self.model.describe()}

    def monitor_config(self, configured: MonitorConfig) -> MonitorConfig:
        """MFU/MBU peaks: the hardware's when simulating one, else the configured ones (this machine's)."""
        if self.hardware is None:
            return configured
        return MonitorConfig(peak_flops=self.hardware.peak_flops_for(self.engine.config.dtype),
                             peak_bandwidth=self.hardware.memory_bandwidth, calibrate=False)

    def serve(self, workload: Sequence[Any], **kwargs: Any) -> RunResult:
        """``serving.serve`` on the virtual clock: nothing sleeps; ``wall_time`` is simulated seconds."""
        kwargs.setdefault("progress", False)
        return serve(self.engine, workload, clock=self.clock, annotations=self.annotations, **kwargs)


def _target_len(output_lengths: Mapping[str, int] | None):
    if not output_lengths:
        return None
    lengths = dict(output_lengths)

    def target(request: Request) -> int:
        return lengths.get(request.request_id, request.max_tokens)

    return target
