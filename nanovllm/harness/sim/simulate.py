"""A simulated run: the real engine (scheduler, policy, allocator) on a ``SimulatedRunner`` and a virtual
clock, served by the same loop as a real run (``nanovllm.harness.serving.serve``), so it writes the same
records and files. From Python::

    sim = Simulation.build(EngineConfig(num_kv_blocks=512), "calibrated", scheduler="priority")
    result = sim.serve(generate_workload(SyntheticWorkloadConfig(num_requests=10_000, request_rate=20),
                                         sim.engine.tokenizer))

``python -m nanovllm.run runner=sim`` builds the same thing from the Hydra config (``Simulation.from_config``),
and serves through it exactly as through a real engine: a ``Simulation`` is a ``ServedEngine`` whose clock is
virtual and whose cost model and MFU/MBU peaks are the simulated machine's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from nanovllm.config import EngineConfig, torch_dtype
from nanovllm.engine.engine import PluginSpec
from nanovllm.engine.sim_runner import simulated_engine
from nanovllm.harness.serving import RunResult, ServedEngine
from nanovllm.harness.sim.hardware import Hardware
from nanovllm.harness.sim.speculation import (
    ProposerCost,
    SpeculativeStepTime,
    analytical_cost,
    build_acceptance,
    calibrated_cost,
)
from nanovllm.harness.sim.step_time import STEP_TIME_MODELS, CalibratedStepTime, StepTimeModel
from nanovllm.models.loader import resolve_model
from nanovllm.request import Request
from nanovllm.serving.monitor import ModelCost, MonitorConfig
from nanovllm.serving.records import read_run

# The runner keys of conf/runner/sim.yaml, and those only the token_cost step-time model reads.
TOKEN_COST_KEYS = ("step_overhead", "time_per_token")
# Simulated speculation (nanovllm.harness.sim.speculation): the acceptance model and its inputs.
ACCEPTANCE_KEYS = ("acceptance", "acceptance_run", "acceptance_seed")
SIM_RUNNER_KEYS = ("name", "step_time", "profile", "replay_run", "output_lengths_from", "fast_forward",
                   *TOKEN_COST_KEYS, *ACCEPTANCE_KEYS)


def output_lengths_of(run_dir: str | Path) -> dict[str, int]:
    """request_id -> output tokens of a recorded run (the targets a simulation of that run stops at)."""
    return {r["request_id"]: r["num_output_tokens"] for r in read_run(run_dir, missing_ok=False).requests}


@dataclass
class Simulation(ServedEngine):
    """A simulated engine (its clock is the simulated runner's virtual one) and its step-time model, ready to
    ``serve`` a workload."""

    model: StepTimeModel
    hardware: Hardware | None = None

    @classmethod
    def build(cls, config: EngineConfig, step_time: str | Mapping[str, Any], *, scheduler: PluginSpec = "fcfs",
              allocator: PluginSpec = "paged", attention: PluginSpec = "torch", profile: str | None = None,
              replay_run: str | None = None, hardware: Hardware | None = None,
              output_lengths: Mapping[str, int] | None = None, acceptance: Any = None,
              acceptance_run: str | None = None, acceptance_seed: int = 0,
              fast_forward: bool = True) -> "Simulation":
        """Build the engine around the step-time model ``step_time``: a registered name (``STEP_TIME_MODELS``)
        or ``{"name": ..., **options}`` (``{"name": "token_cost", "step_overhead": 1, "time_per_token": 0}``
        counts engine steps). ``output_lengths``: request_id ->
        target output length (others stop at ``max_tokens``); a replay takes them from its run by default.
        With ``hardware`` and no ``num_kv_blocks``/``kv_cache_memory``, the KV cache gets the memory the
        weights leave (an error naming ``hardware.memory_bytes`` when they do not fit). A ``calibrated`` profile
        measured on another machine says so in one warning, logged (``machine_warning``). With
        ``config.speculative``: ``acceptance`` (a rate, ``fitted`` or ``replay``), ``acceptance_run`` and
        ``acceptance_seed`` are ``runner.acceptance*`` (``speculation.build_acceptance``), and the step-time model
        prices proposals and the proposer (``speculation.SpeculativeStepTime``; ``replay`` replays the recorded
        steps, proposer included). ``fast_forward``: runs of pure-decode steps are computed at once where that is
        provably what stepping gives (``nanovllm.engine.decode_stretch``; records identical), for a step-time
        model that is pure (not ``replay``)."""
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(resolve_model(config.model))
        cost = ModelCost.from_hf_config(hf_config, torch_dtype(config.dtype), config.kv_cache_dtype,
                                        config.quantization, config.model)
        config = _kv_sized(config, cost, hardware)
        options = dict(step_time) if isinstance(step_time, Mapping) else {"name": step_time}
        model = STEP_TIME_MODELS.build({"profile": profile, "run": replay_run, "cost": cost, "hardware": hardware,
                                        "dtype": config.dtype, "model": config.model,
                                        "kv_cache_dtype": config.kv_cache_dtype,
                                        "quantization": config.quantization,
                                        "tensor_parallel_size": config.tensor_parallel_size, **options})
        warnings = ([model.machine_warning(), model.kv_cache_warning(), model.quantization_warning()]
                    if isinstance(model, CalibratedStepTime) else [])
        for warning in filter(None, warnings):
            logging.getLogger(__name__).warning(warning)
        if output_lengths is None and replay_run:
            output_lengths = output_lengths_of(replay_run)
        accepting = None
        if config.speculative is not None:
            model = _speculative_model(model, options["name"], config, hf_config, cost, hardware)
            accepting = build_acceptance(acceptance, acceptance_run, acceptance_seed,
                                         str(config.speculative["method"]),
                                         int(config.speculative["num_speculative_tokens"]))
        engine = simulated_engine(config, model.predict, scheduler=scheduler, allocator=allocator,
                                  attention=attention, target_len=_target_len(output_lengths),
                                  kv_links=tier_links(hardware, model), acceptance=accepting,
                                  fast_forward=fast_forward and model.pure)
        return cls(engine, engine.runner.clock, cost, model, hardware)

    def replica(self, config: EngineConfig, **plugins: PluginSpec) -> "Simulation":
        """Another simulated engine of the same model on the same step-time model (and output lengths), its
        own scheduler, policy and allocator built from ``plugins`` with the engine settings ``config``: the
        replicas of a simulated cluster, which share this one's tokenizer, HF config and model."""
        engine = simulated_engine(_kv_sized(config, self.cost, self.hardware), self.model.predict,
                                  target_len=self.engine.runner.target_len, tokenizer=self.engine.tokenizer,
                                  hf_config=self.engine.hf_config,
                                  kv_links=tier_links(self.hardware, self.model),
                                  acceptance=self.engine.runner.acceptance,
                                  fast_forward=getattr(self.engine.runner, "fast_forward", False), **plugins)
        return type(self)(engine, engine.runner.clock, self.cost, self.model, self.hardware)

    @classmethod
    def from_config(cls, runner: Mapping[str, Any], hardware: Mapping[str, Any] | None, config: EngineConfig,
                    **plugins: PluginSpec) -> "Simulation":
        """From the Hydra ``runner`` and ``hardware`` nodes (already checked by ``check_runner``)."""
        lengths_run = runner.get("output_lengths_from")
        step_time = {"name": str(runner["step_time"]),
                     **{key: runner[key] for key in TOKEN_COST_KEYS if runner.get(key) is not None}}
        return cls.build(
            config, step_time, profile=runner.get("profile"), replay_run=runner.get("replay_run"),
            hardware=Hardware.from_config(hardware) if hardware is not None else None,
            output_lengths=output_lengths_of(lengths_run) if lengths_run else None,
            acceptance=runner.get("acceptance"), acceptance_run=runner.get("acceptance_run"),
            acceptance_seed=runner.get("acceptance_seed") if runner.get("acceptance_seed") is not None else 0,
            fast_forward=bool(runner.get("fast_forward", True)), **plugins,
        )

    @property
    def annotations(self) -> dict[str, Any]:
        """What ``metrics.json`` gains: that the run was simulated, and with which step-time model."""
        acceptance = self.engine.runner.acceptance
        return {"simulated": True, "step_time_model": self.model.describe(),
                **({"acceptance_model": acceptance.describe()} if acceptance is not None else {})}

    def monitor_config(self, configured: MonitorConfig) -> MonitorConfig:
        """MFU/MBU peaks: the hardware's when simulating one; none for a step-time model whose seconds are no
        machine's (``token_cost``); else the configured ones (this machine's). A replica of N tensor-parallel
        GPUs has N times one GPU's peaks."""
        if self.hardware is not None:
            gpus = self.engine.config.tensor_parallel_size
            return MonitorConfig(peak_flops=gpus * self.hardware.matmul_peak_flops(self.engine.config.dtype,
                                                                                self.cost.int8_matmuls),
                                 peak_bandwidth=gpus * self.hardware.memory_bandwidth, calibrate=False)
        return configured if self.model.machine_seconds else MonitorConfig(calibrate=False)

    def serve(self, workload: Sequence[Any], **kwargs: Any) -> RunResult:
        """``serving.serve`` on the virtual clock: nothing sleeps; ``wall_time`` is simulated seconds."""
        kwargs.setdefault("progress", False)
        with simulation_gc():
            return super().serve(workload, **kwargs)


#: The garbage collector's thresholds while a simulation serves (``gc.set_threshold``): a collection of the
#: young generation after this many more allocations than frees, of the middle one after this many of those, and
#: of all objects after this many of the middle one's.
SIMULATION_GC_THRESHOLDS = (50_000, 20, 100)


@contextlib.contextmanager
def simulation_gc() -> Iterator[None]:
    """Collect garbage less often while a simulation runs, then as before. A simulated GPU-scale run holds
    millions of small container objects (a prefix cache's blocks, their eviction entries, every request's
    tokens) and allocates and frees more at every step; at Python's default thresholds the collector walks
    them so often that it takes a large share of the run. Nothing is left uncollected: cycles still go, in
    fewer, larger collections."""
    before = gc.get_threshold()
    gc.set_threshold(*SIMULATION_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def tier_links(hardware: Hardware | None, model: StepTimeModel) -> Mapping[str, Mapping[str, float]] | None:
    """The links tier moves are priced on: the simulated hardware's (``hardware.kv_tier_links``) where it gives
    any, else those the step-time model was measured with (a profile calibrated on runs with KV tiers), else
    None (moves cost no simulated time)."""
    if hardware is not None and hardware.kv_tier_links:
        return hardware.kv_tier_links
    return getattr(model, "kv_tier_links", None) or None


def _kv_sized(config: EngineConfig, cost: ModelCost, hardware: Hardware | None) -> EngineConfig:
    """With ``hardware`` and no ``num_kv_blocks``/``kv_cache_memory``: the KV cache gets the memory the weights
    (as stored: ``ModelCost.weight_memory_bytes``, int8 or GGUF blocks when quantized) leave on it, on each of
    the ``tensor_parallel_size`` GPUs of the replica (``Hardware.kv_cache_bytes`` says when they do not fit)."""
    if hardware is None:
        return config
    kv_bytes = hardware.kv_cache_bytes(cost.weight_memory_bytes, config.tensor_parallel_size)
    if config.num_kv_blocks is None and config.kv_cache_memory is None:
        return dataclasses.replace(config, kv_cache_memory=kv_bytes)
    return config


def _speculative_model(model: StepTimeModel, name: str, config: EngineConfig, hf_config: Any, cost: ModelCost,
                       hardware: Hardware | None) -> StepTimeModel:
    """``model`` made to price steps with proposals and the proposer's own work (``SpeculativeStepTime``): a
    calibrated profile's ``speculation`` section, the analytical roofline of the draft model (or the target's
    early layers) for ``analytical``/``profiled``, nothing for ``token_cost``; ``replay`` as it is (its recorded
    steps took what they took, proposer included)."""
    assert config.speculative is not None
    if name == "replay":
        return model
    if isinstance(model, CalibratedStepTime):
        proposer = calibrated_cost(model.profile, model.path, str(config.speculative["method"]))
    elif name in ("analytical", "profiled"):
        proposer = analytical_cost(config.speculative, hf_config, cost, hardware, config.dtype)
    else:
        proposer = ProposerCost()
    return SpeculativeStepTime(model, proposer)


def _target_len(output_lengths: Mapping[str, int] | None):
    if not output_lengths:
        return None
    lengths = dict(output_lengths)

    def target(request: Request) -> int:
        return lengths.get(request.request_id, request.max_tokens)

    return target
