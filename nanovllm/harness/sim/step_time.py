"""Step-time models: how long one engine step takes, predicted from the batch's features.

A model is a plugin like a policy (``STEP_TIME_MODELS``, ``@register_step_time``) with one method,
``predict(features, now) -> seconds``. ``features`` are the keys of a ``StepRecord`` that describe the batch
(``num_prefill_tokens``, ``num_decode_seqs``, ``num_sampled``, ``context_tokens``, ``attn_pairs``, ...), the
same numbers the engine writes to ``steps.jsonl``, so a model fitted on real runs reads them unchanged.

* ``calibrated``: a linear model fitted on real runs (``nanovllm.harness.sim.calibrate``), loaded from a
  profile YAML (by default this machine's own, made by ``calibrate --this-machine``, else the shipped one for
  the default model in the engine's dtype, ``profiles/smollm2-135m-{dtype}-cpu.yaml``). Each profile records
  the machine it was measured on, and ``runner=sim`` warns when that is not this one
  (``nanovllm.harness.sim.this_machine``). Coefficients are non-negative: each feature can only add time.
  A profile may also split the steps by matmul kernel (``gemv_max_rows``, ``KERNEL_FEATURES``) and carry the
  serving loop's own time between steps (``step_gap``), which every predicted step then includes.
* ``analytical``: a roofline estimate from the monitor's cost model (FLOPs and bytes of the step) and a
  hardware description: ``overhead + max(flops / achievable FLOP/s, bytes / achievable bytes/s)``. An estimate.
* ``profiled``: GPU operator timings measured by Vidur (its ``mlp.csv`` and, where there is one,
  ``attention.csv``, from the directory ``runner.profile``), interpolated by token count and summed over the
  layers; attention from the analytical roofline where the directory has no ``attention.csv``, the LM head and
  the per-step overhead from it always. Measurements where the profile has them, estimates elsewhere.
* ``replay``: the step timeline of a recorded run, in order -- each step ends when the recorded run's next
  step started, so the gaps between steps (the serving loop's own work) are replayed too and arrivals land
  in the same steps. For exact-schedule checks.
* ``token_cost``: ``step_overhead + time_per_token x`` the tokens the step computes, the first-order cost of a
  step on any hardware (a long prefill is a long step), the same on every machine. ``time_per_token=0`` with
  ``step_overhead=1`` counts time in engine steps. The policy-effect tests and the policy-library study
  (``experiments/policy_library.py``) run on it.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import yaml

from nanovllm.harness.sim.hardware import Hardware, check_kv_tier_links
from nanovllm.harness.sim.operator_profile import read_attention_profile, read_mlp_profile, split_attention
from nanovllm.harness.sim.this_machine import cached_profile, calibrate_command, mismatch
from nanovllm.registry import Registry
from nanovllm.serving.monitor import ModelCost, as_floats
from nanovllm.serving.records import read_run

# What the calibrated model regresses on (besides a per-step intercept).
CALIBRATION_FEATURES = ("num_prefill_tokens", "num_decode_seqs", "num_sampled", "context_tokens", "attn_pairs")

# Derived from the recorded features: which matmul kernel ran the step's linear layers. On CPU in bfloat16 the
# engine sends inputs of at most ``gemv_max_rows`` rows (decode steps of one or two sequences) through its GEMV
# kernel and larger ones through oneDNN's GEMM (``nanovllm.models.fast_path.PackedLinear``). The two cost
# differently: the GEMV reads the weights once per row, the GEMM once per step, so a step time linear in the
# row count is off on both sides of the switch (too low just above it, too high further up). In float32 every
# row count goes through oneDNN's prepacked
# GEMM, which switches kernels by row count itself (3-sequence decodes measured slower than 4-sequence ones); the
# calibration finds that switch from the steps and stores it as ``gemv_max_rows`` too (``gemv_rows`` then counts
# the rows of oneDNN's few-row kernel).
KERNEL_FEATURES = ("gemv_rows", "gemm_step")


# A roofline's bend, for servers calibrated from the outside (``calibrate_server``): a step whose rows (prefill
# tokens + decode sequences) are few costs about the same whatever their number (the pass is bound by reading
# the weights), and past some row count each further row adds compute. ``max(W, c * rows)`` is
# ``W + c * max(0, rows - W / c)``: the profile's ``knee_rows`` is the bend, this feature the rows past it.
KNEE_FEATURE = "rows_above_knee"


def rows_above_knee(features: Mapping[str, int], knee_rows: int) -> int:
    """The step's rows (prefill tokens + decode sequences) beyond ``knee_rows``, 0 when it has no more."""
    return max(0, features["num_prefill_tokens"] + features["num_decode_seqs"] - knee_rows)


def kernel_features(features: Mapping[str, int], gemv_max_rows: int) -> dict[str, int]:
    """``gemv_rows``: the step's rows (prefill tokens + decode sequences) when they go through the few-row
    GEMV kernel, else 0; ``gemm_step``: 1 when they go through the GEMM instead (more than ``gemv_max_rows``)."""
    rows = features["num_prefill_tokens"] + features["num_decode_seqs"]
    return {"gemv_rows": rows if rows <= gemv_max_rows else 0, "gemm_step": int(rows > gemv_max_rows)}


def with_kernel_features(step: Mapping[str, Any], gemv_max_rows: int | None) -> Mapping[str, Any]:
    """``step`` with its ``kernel_features`` added for a profile split at ``gemv_max_rows`` (None: ``step``)."""
    return step if gemv_max_rows is None else {**step, **kernel_features(step, gemv_max_rows)}


def working_steps(steps: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The steps that ran a batch (prefill tokens or decodes). A step in which only rejected requests ended never
    reached the model runner, so it has no step time to fit, predict or replay."""
    return [s for s in steps if s["num_prefill_tokens"] + s["num_decode_seqs"] > 0]


class StepTimeModel(abc.ABC):
    """Predicts one step's duration in seconds. ``now`` is the simulated time at the step's start.

    ``machine_seconds``: whether its seconds are some machine's (this one's, or a ``hardware`` description's),
    so that FLOP/s and bytes/s against that machine's peaks (MFU, MBU) mean something."""

    machine_seconds: bool = True
    # Whether ``predict`` is a pure function of its arguments (the engine may then ask it for a run of decode
    # steps ahead: ``runner.fast_forward``); a replayed timeline is not, each call takes the next recorded step.
    pure: bool = True
    # The KV tiers' links this model's seconds were measured with (a ``calibrated`` profile fitted on runs with
    # ``kv_offload``), as ``hardware.kv_tier_links``; the simulator prices tier moves on them when no ``hardware``
    # gives links of its own. Empty: none measured.
    kv_tier_links: Mapping[str, Mapping[str, float]] = {}

    @abc.abstractmethod
    def predict(self, features: Mapping[str, int], now: float) -> float:
        """Seconds the step with these features (a ``StepRecord``'s batch fields) takes."""

    def describe(self) -> str:
        """What the run's ``metrics.json`` says under ``step_time_model``."""
        return str(getattr(self, "registered_name", type(self).__name__))

    def predict_decodes(self, size: int, context: np.ndarray) -> np.ndarray | None:
        """``predict`` of many pure-decode steps of ``size`` requests at once, step ``j`` over ``context[j]``
        tokens of context, each value exactly what ``predict`` gives it (decode stretches ask for runs of
        steps); None: this model has no such shortcut (the default), ask ``predict`` step by step. Only for a
        model whose ``predict`` does not read ``now``."""
        return None


STEP_TIME_MODELS: Registry[StepTimeModel] = Registry("step-time model", base=StepTimeModel,
                                                     builtin_packages=("nanovllm.harness.sim.step_time",))


def _floats(values: np.ndarray) -> np.ndarray:
    """``values`` as float64, each converted as ``float()`` converts it (``as_floats``, without its Python loop
    where the values are already machine integers or floats)."""
    return as_floats(values) if values.dtype == object else values.astype(np.float64)


def register_step_time(name: str) -> Callable[[type[StepTimeModel]], type[StepTimeModel]]:
    """Class decorator registering a ``StepTimeModel`` subclass under ``name``."""
    return STEP_TIME_MODELS.register(name)


@register_step_time("calibrated")
class CalibratedStepTime(StepTimeModel):
    """``step_gap + intercept + sum(coefficient[f] * features[f])`` from a profile written by ``calibrate``;
    ``f`` also ranges over ``KERNEL_FEATURES`` when the profile has ``gemv_max_rows``, and over ``KNEE_FEATURE``
    when it has ``knee_rows`` (``calibrate_server`` fits one where the server's steps bend). ``step_gap`` (0 when
    absent) is the serving loop's own time between one step's end and the next one's start: like ``replay``,
    each simulated step lasts until the next one can start, so arrivals land in the same steps as for real."""

    def __init__(self, profile: str | Path | None = None, dtype: str = "float32", model: str | None = None,
                 kv_cache_dtype: str = "auto", quantization: str | None = None, **context: Any) -> None:
        """``profile``: a profile YAML; None picks this machine's own for ``model`` (None: the default model) in
        ``dtype`` when one was calibrated (``this_machine.cached_profile``: the one of this run's
        ``quantization`` and ``kv_cache_dtype``, else the dense one), else the shipped one (``shipped_profile``).
        A profile that records another dtype than ``dtype`` is an error; one fitted on runs with another
        ``kv_cache_dtype`` (no record: ``auto``) or ``quantization`` (no record: dense weights) is used, and
        ``kv_cache_warning`` / ``quantization_warning`` say so."""
        # This machine's own profile (calibrate --this-machine), when there is one for the default model: of
        # this run's weights and KV cache where calibrated, else the dense one (which then warns).
        self.cached = None
        if not profile and model in (None, ""):
            self.cached = cached_profile(dtype, quantization, kv_cache_dtype) or cached_profile(dtype)
        path = Path(profile) if profile else self.cached or shipped_profile(dtype, model)
        if not path.is_file():
            raise ValueError(f"runner.profile: calibration profile {str(path)!r} does not exist "
                             "(make one with python -m nanovllm.harness.sim.calibrate RUN_DIR... --out FILE)")
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("coefficients"), dict) or "intercept" not in data:
            raise ValueError(f"runner.profile: {path} is not a calibration profile (needs intercept and coefficients)")
        if data.get("dtype") and data["dtype"] != dtype:
            raise ValueError(f"runner.profile: {path.name} was calibrated with engine.dtype={data['dtype']}, but this "
                             f"run uses engine.dtype={dtype}; give a profile calibrated in {dtype} or set "
                             f"engine.dtype={data['dtype']}")
        self.path = path
        self.profile = data
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.quantization = quantization or "none"
        self.explicit = bool(profile)
        self.intercept = float(data["intercept"])
        terms = [(name, float(value)) for name, value in data["coefficients"].items() if value]
        self.coefficients = [(name, value) for name, value in terms
                             if name not in KERNEL_FEATURES and name != KNEE_FEATURE]
        self.kernel_coefficients = [(name, value) for name, value in terms if name in KERNEL_FEATURES]
        self.gemv_max_rows: int | None = data.get("gemv_max_rows")
        self.knee_rows: int | None = data.get("knee_rows")
        self.knee_coefficient = float(data["coefficients"].get(KNEE_FEATURE) or 0.0)
        if self.knee_coefficient and self.knee_rows is None:
            raise ValueError(f"runner.profile: {path} has a {KNEE_FEATURE} coefficient but no knee_rows")
        self.step_gap = float(data.get("step_gap") or 0.0)
        try:
            self.kv_tier_links = check_kv_tier_links(data.get("kv_tier_links") or {})
        except ValueError as err:
            raise ValueError(f"runner.profile: {path}: {err}") from None

    def predict(self, features: Mapping[str, int], now: float) -> float:
        seconds = self.step_gap + self.intercept
        for name, coefficient in self.coefficients:
            seconds += coefficient * features[name]
        if self.gemv_max_rows is not None:
            kernel = kernel_features(features, self.gemv_max_rows)
            for name, coefficient in self.kernel_coefficients:
                seconds += coefficient * kernel[name]
        if self.knee_coefficient:
            seconds += self.knee_coefficient * rows_above_knee(features, self.knee_rows or 0)
        return seconds

    def describe(self) -> str:
        """``calibrated:<file>``; this machine's cached profile as ``calibrated:<machine key>/<file>``."""
        return f"calibrated:{self.path.parent.name}/{self.path.name}" if self.cached else f"calibrated:{self.path.name}"

    def _fitted_otherwise(self, key: str, default: str, ours: str) -> str | None:
        """The start of a warning when the profile's runs had another ``engine.<key>`` than ours (a profile that
        records none had ``default``), else None."""
        fitted = self.profile.get(key) or default
        if fitted == ours:
            return None
        return f"runner.profile: {self.path.name} was fitted on runs with engine.{key}={fitted}, this run uses {ours}"

    def _calibrate_hint(self) -> str:
        """The command that calibrates this machine for this run's settings (dtype, threads, weights, KV cache)."""
        import torch

        quantization = None if self.quantization == "none" else self.quantization
        return calibrate_command(self.dtype, torch.get_num_threads(), quantization, self.kv_cache_dtype)

    def kv_cache_warning(self) -> str | None:
        """One line when the profile's runs had another KV-cache dtype than this run (an 8-bit cache changes
        what attention costs: the profile's ``context_tokens``/``attn_pairs`` terms are the other cache's);
        None when they match. A profile that records none was fitted on model-dtype caches (``auto``)."""
        start = self._fitted_otherwise("kv_cache_dtype", "auto", self.kv_cache_dtype)
        fitted = self.profile.get("kv_cache_dtype") or "auto"
        return None if start is None else (
            f"{start}: its attention terms are those of the {fitted} cache (for that cache's step times, "
            f"calibrate from runs with engine.kv_cache_dtype={self.kv_cache_dtype}: `{self._calibrate_hint()}`); "
            "the KV memory, blocks and preemptions are this run's")

    def quantization_warning(self) -> str | None:
        """One line when the profile's runs had other weights than this run (``quantization``: int8 or GGUF
        blocks change what every linear costs); None when they match (no record: dense weights)."""
        start = self._fitted_otherwise("quantization", "none", self.quantization)
        fitted = self.profile.get("quantization") or "none"
        return None if start is None else (
            f"{start}: its linear-layer terms are those of {'dense' if fitted == 'none' else fitted} weights "
            f"(for their step times, calibrate from runs with engine.quantization={self.quantization}: "
            f"`{self._calibrate_hint()}`)")

    def machine_warning(self) -> str | None:
        """One line when the profile was measured on another machine than this one (another CPU
        model, ISA level or torch thread count), naming both and the command that calibrates this one; None
        when it matches or records no machine (``this_machine.mismatch``)."""
        shipped = not self.explicit and not self.cached
        return mismatch(self.profile, f"{self.path.name} (shipped)" if shipped else str(self.path), self.dtype)


def check_tensor_parallel(hardware: Hardware, tensor_parallel_size: int) -> int:
    """``tensor_parallel_size`` as a step-time model prices it: an error naming the field when it is not a
    positive integer, or when it is above 1 and ``hardware`` describes no link between the GPUs."""
    tp = tensor_parallel_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"engine.tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if tp > 1 and hardware.tp_link_bandwidth is None:
        raise ValueError(f"hardware.tp_link_bandwidth: {hardware.name} names no link between its GPUs, so "
                         f"engine.tensor_parallel_size={tp} cannot be priced (add tp_link_bandwidth, bytes/s)")
    return tp


def tensor_parallel_seconds(cost: ModelCost, hardware: Hardware, tp: int, features: Mapping[str, int]) -> float:
    """The collectives of one step of a replica split over ``tp`` GPUs, as Megatron-style tensor parallelism
    (vLLM's) runs it: two all-reduces of the step's hidden states per layer (after the attention output and the
    MLP down projections, whose inputs are split by rank) and one gather of the sampled rows' logits (the LM head
    is split by vocabulary). A ring all-reduce moves ``2 (tp - 1) / tp`` of the message through each GPU's link,
    a gather ``(tp - 1) / tp``; each collective also costs ``hardware.tp_link_latency``. 0 for one GPU."""
    if tp == 1:
        return 0.0
    assert hardware.tp_link_bandwidth is not None   # check_tensor_parallel
    tokens = features["num_prefill_tokens"] + features["num_decode_tokens"]
    hidden = tokens * cost.hidden_size * cost.bytes_per_element
    seconds = 2 * cost.num_layers * (hardware.tp_link_latency
                                     + 2 * (tp - 1) / tp * hidden / hardware.tp_link_bandwidth)
    if features["num_sampled"]:
        logits = features["num_sampled"] * cost.vocab_size * cost.bytes_per_element
        seconds += hardware.tp_link_latency + (tp - 1) / tp * logits / hardware.tp_link_bandwidth
    return seconds


@register_step_time("analytical")
class AnalyticalStepTime(StepTimeModel):
    """Roofline: per-step overhead plus the slower of compute and memory traffic, on ``hardware``. With quantized
    weights (``cost.int8_matmuls``) the linears' products run at the int8 peak and attention at the dtype's, and
    the weights stream as stored (``ModelCost.weight_bytes``). With ``tensor_parallel_size`` N > 1 the step's
    FLOPs and bytes are split evenly over N GPUs working at once, and its collectives over their link are added
    (``tensor_parallel_seconds``: they wait for the compute before them, so they do not overlap it)."""

    def __init__(self, cost: ModelCost, hardware: Hardware | None, dtype: str, tensor_parallel_size: int = 1,
                 **context: Any) -> None:
        if hardware is None:
            raise ValueError("hardware is not set; the analytical step-time model needs one, e.g. hardware=h100_sxm")
        self.cost = cost
        self.hardware = hardware
        self.tp = check_tensor_parallel(hardware, tensor_parallel_size)
        self.flops_per_s = hardware.peak_flops_for(dtype) * hardware.flops_efficiency
        self.matmul_flops_per_s = hardware.matmul_peak_flops(dtype, cost.int8_matmuls) * hardware.flops_efficiency
        self.bytes_per_s = hardware.memory_bandwidth * hardware.bandwidth_efficiency

    def predict(self, features: Mapping[str, int], now: float) -> float:
        compute = (self.cost.step_matmul_flops(features) / self.matmul_flops_per_s
                   + self.cost.step_attention_flops(features) / self.flops_per_s)
        memory = self.cost.step_bytes(features) / self.bytes_per_s
        return (self.hardware.step_overhead + max(compute, memory) / self.tp
                + tensor_parallel_seconds(self.cost, self.hardware, self.tp, features))

    def predict_decodes(self, size: int, context: np.ndarray) -> np.ndarray:
        """``predict`` of pure-decode steps, element-wise with the same operations in the same order."""
        # The cost model's integer products, exactly: in int64 while they cannot overflow (a context below 2**31
        # times the model's per-token factors, each below 2**31), else as Python ints. Either converts to the
        # float ``float()`` gives (both round to nearest).
        tokens = context.astype(np.int64) if len(context) and int(context.max()) < 2**31 else context.astype(object)
        features: dict[str, Any] = {"num_prefill_tokens": 0, "num_decode_tokens": size, "num_prefill_seqs": 0,
                                    "num_decode_seqs": size, "context_tokens": tokens, "attn_pairs": tokens,
                                    "num_sampled": size}
        compute = (float(self.cost.step_matmul_work(features)) / self.matmul_flops_per_s
                   + _floats(self.cost.step_attention_work(features)) / self.flops_per_s)
        memory = _floats(self.cost.step_bytes_work(features)) / self.bytes_per_s
        collectives = tensor_parallel_seconds(self.cost, self.hardware, self.tp, {**features, "context_tokens": 0,
                                                                                   "attn_pairs": 0})
        return self.hardware.step_overhead + np.maximum(compute, memory) / self.tp + collectives

    def kernel_seconds(self, flops: Any, nbytes: Any, floor: float = 0.0) -> Any:
        """One kernel's roofline on ``hardware`` at the rates ``predict`` uses: the slower of its FLOPs at the
        linears' achievable FLOP/s and its bytes at the achievable bandwidth, and at least ``floor`` seconds (a
        kernel's launch: GPU kernels of a few rows take that however little they compute). Arrays of kernels
        give an array. Not called by the engine: ``nanovllm.harness.sim.fit_hardware`` compares it with measured
        operator timings (``ModelCost.layer_operator_costs``) to fit the hardware's efficiencies."""
        return np.maximum(floor, np.maximum(np.asarray(flops) / self.matmul_flops_per_s,
                                            np.asarray(nbytes) / self.bytes_per_s))

    def describe(self) -> str:
        return f"analytical:{self.hardware.name}"


@register_step_time("profiled")
class ProfiledStepTime(StepTimeModel):
    """Measured GPU operator timings (Vidur's profiles, ``nanovllm.harness.sim.operator_profile``) summed over
    the step: ``overhead + layers x (the per-layer operators of mlp.csv at the step's tokens + attention) + the
    embedding + the LM head``. Attention comes from ``attention.csv`` when the directory has one (prefill by
    (query, key) pairs, decode by KV tokens read, per layer), else from the analytical roofline on ``hardware``;
    the LM head (not in Vidur's profiles) and the per-step overhead always do. A profile is one tensor-parallel
    degree's per-rank timings: the rows of ``engine.tensor_parallel_size`` are used, the analytical parts are
    split over the ranks too, and the collectives between them are priced as the analytical model prices them
    (``tensor_parallel_seconds``)."""

    def __init__(self, profile: str | Path | None, cost: ModelCost, hardware: Hardware | None, dtype: str,
                 tensor_parallel_size: int = 1, **context: Any) -> None:
        """``profile``: the directory holding Vidur's ``mlp.csv`` (and optionally ``attention.csv``) of this
        model on the GPU ``hardware`` describes, e.g. Vidur's ``data/profiling/compute/h100/meta-llama/
        Llama-2-7b-hf``. Called once when the simulated engine is built."""
        if not profile:
            raise ValueError("runner.profile: the profiled step-time model needs the directory of a Vidur profile "
                             "(mlp.csv, optionally attention.csv), e.g. vidur/data/profiling/compute/h100/"
                             "meta-llama/Llama-2-7b-hf")
        if hardware is None:
            raise ValueError("hardware is not set; the profiled step-time model needs the GPU its profile was measured "
                             "on (it prices the LM head and, without attention.csv, attention), e.g. hardware=h100_sxm")
        directory = Path(profile).expanduser()
        if not directory.is_dir():
            raise ValueError(f"runner.profile: {str(profile)!r} is not a directory (the profiled step-time model "
                             "reads mlp.csv and attention.csv from one)")
        self.directory = directory
        self.tp = check_tensor_parallel(hardware, tensor_parallel_size)
        self.cost = cost
        self.hardware = hardware
        self.linear = read_mlp_profile(directory / "mlp.csv", self.tp, cost)
        attention = directory / "attention.csv"
        self.attention = read_attention_profile(attention, self.tp, cost) if attention.is_file() else None
        self.flops_per_s = hardware.peak_flops_for(dtype) * hardware.flops_efficiency
        self.matmul_flops_per_s = hardware.matmul_peak_flops(dtype, cost.int8_matmuls) * hardware.flops_efficiency
        self.bytes_per_s = hardware.memory_bandwidth * hardware.bandwidth_efficiency

    def attention_seconds(self, features: Mapping[str, int]) -> float:
        """Attention's kernel time in the step, all layers: from the profile, else the analytical roofline (its
        FLOPs against the compute peak, the KV cache read and written against bandwidth), split over the ranks."""
        if self.attention is not None:
            prefill_pairs, decode_kv = split_attention(features)
            per_layer_ms = self.attention.prefill(prefill_pairs) + self.attention.decode(decode_kv)
            return self.cost.num_layers * per_layer_ms / 1000.0
        tokens = features["num_prefill_tokens"] + features["num_decode_tokens"]
        compute = self.cost.step_attention_flops(features) / self.flops_per_s
        memory = (features["context_tokens"] + tokens) * self.cost.kv_bytes_per_token / self.bytes_per_s
        return max(compute, memory) / self.tp

    def lm_head_seconds(self, features: Mapping[str, int]) -> float:
        """The LM head over the rows that sample (analytical: Vidur's profiles leave it out), split over ranks."""
        if features["num_sampled"] == 0:
            return 0.0
        params = self.cost.lm_head_params
        compute = 2 * params * features["num_sampled"] / self.matmul_flops_per_s
        memory = params * self.cost.bytes_per_element / self.bytes_per_s
        return max(compute, memory) / self.tp

    def predict(self, features: Mapping[str, int], now: float) -> float:
        tokens = features["num_prefill_tokens"] + features["num_decode_tokens"]
        linear_ms = self.cost.num_layers * self.linear.layer_ms(tokens) + self.linear.step_ms(tokens)
        return (self.hardware.step_overhead + linear_ms / 1000.0 + self.attention_seconds(features)
                + self.lm_head_seconds(features) + tensor_parallel_seconds(self.cost, self.hardware, self.tp, features))

    def describe(self) -> str:
        attention = "profiled" if self.attention is not None else "analytical"
        return f"profiled:{self.directory.name}/tp{self.tp}/attention={attention}:{self.hardware.name}"


@register_step_time("replay")
class ReplayStepTime(StepTimeModel):
    """The recorded run's step timeline, in order; running past its last step is an error (the simulated
    schedule has diverged from the recorded one)."""

    pure = False

    def __init__(self, run: str | Path | None = None, **context: Any) -> None:
        if not run:
            raise ValueError("runner.replay_run: the replay step-time model needs the run directory to replay")
        data = read_run(run, missing_ok=False)
        if not data.steps:
            raise ValueError(f"runner.replay_run: {run} has no steps to replay")
        self.run = Path(run)
        # A step that ran nothing is not asked for here either: it stays inside the gap before the next one.
        steps = working_steps(data.steps)
        self.starts = [float(s["start_time"]) for s in steps]
        self.durations = [float(s["duration"]) for s in steps]
        self.index = 0

    def predict(self, features: Mapping[str, int], now: float) -> float:
        k = self.index
        if k >= len(self.durations):
            raise ValueError(f"runner.replay_run: the simulation needs more steps than the {len(self.durations)} "
                             f"recorded in {self.run}; its schedule diverged from the recorded run's")
        self.index += 1
        if k + 1 < len(self.starts):
            return max(0.0, self.starts[k + 1] - now)
        return self.durations[k]


@register_step_time("token_cost")
class TokenCostStepTime(StepTimeModel):
    """``step_overhead + time_per_token * (prefill tokens + decode sequences)``: a fixed cost per step plus one
    per token computed. Defaults: 16 ms per step and 1 ms per token (a machine computing 1,000 tokens/s with
    16 ms of fixed cost per step); ``step_overhead=1, time_per_token=0``: one time unit per engine step."""

    machine_seconds = False   # a token count's seconds, no machine's: no MFU/MBU

    def __init__(self, step_overhead: float | None = None, time_per_token: float | None = None,
                 **context: Any) -> None:
        self.step_overhead = 0.016 if step_overhead is None else step_overhead
        self.time_per_token = 0.001 if time_per_token is None else time_per_token
        for key in ("step_overhead", "time_per_token"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"runner.{key} must be a number of seconds >= 0, got {value!r}")

    def predict(self, features: Mapping[str, int], now: float) -> float:
        tokens = features["num_prefill_tokens"] + features["num_decode_seqs"]
        return self.step_overhead + self.time_per_token * tokens

    def describe(self) -> str:
        return f"token_cost:{self.step_overhead:g}+{self.time_per_token:g}/token"


PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


def default_profile_path(dtype: str = "float32") -> Path:
    """Where the shipped calibration profile for the default model (SmolLM2-135M) in ``dtype`` on the
    development CPU lives; ``shipped_profiles()`` says which exist."""
    return PROFILES_DIR / f"smollm2-135m-{dtype}-cpu.yaml"


def shipped_profiles() -> dict[str, Path]:
    """dtype -> the shipped profile of the default model in that dtype, for each one that exists."""
    prefix, suffix = "smollm2-135m-", "-cpu.yaml"
    return {p.name[len(prefix):-len(suffix)]: p for p in sorted(PROFILES_DIR.glob(f"{prefix}*{suffix}"))}


def shipped_profile(dtype: str, model: str | None = None) -> Path:
    """The profile the ``calibrated`` model uses without ``runner.profile``: the shipped one for the default
    model in ``dtype``. An error naming ``runner.profile`` when none is shipped for that model or dtype."""
    how = ("pass runner.profile=FILE, a profile calibrated from real runs of this setup "
           "(python -m nanovllm.harness.sim.calibrate RUN_DIR... --out FILE)")
    if model not in (None, ""):
        raise ValueError(f"runner.profile: no calibration profile is shipped for model {model!r} (only for the "
                         f"default model, SmolLM2-135M); {how}")
    shipped = shipped_profiles()
    if dtype not in shipped:
        raise ValueError(f"runner.profile: no calibration profile is shipped for the default model in "
                         f"engine.dtype={dtype} (shipped: {', '.join(shipped) or 'none'}); {how}, e.g. with "
                         f"python experiments/sim_accuracy.py calibrate --dtype {dtype}; or set engine.dtype to a "
                         "shipped one")
    return shipped[dtype]
