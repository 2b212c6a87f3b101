"""Fit a hardware description's efficiencies to GPU operator timings measured by Vidur (its ``mlp.csv``).

The analytical step-time model (``step_time.AnalyticalStepTime``) prices a kernel as the slower of its FLOPs at
``peak x flops_efficiency`` and its bytes at ``bandwidth x bandwidth_efficiency``. Vidur publishes, per GPU and
model, the median time of each operator of a decoder layer at 1 to 4,096 (32,768) tokens
(``operator_profile.read_mlp_profile`` reads them). This module puts the two side by side per operator and per
token count -- the FLOPs and bytes of each operator from ``ModelCost.layer_operator_costs``, the roofline from
``AnalyticalStepTime.kernel_seconds``, the same code the simulator runs -- and fits by least squares on the log
of predicted over measured time (a 3 us layernorm and a 1 ms matmul weigh alike; so does each token range):

* on the four matmuls, ``flops_efficiency`` and ``bandwidth_efficiency``: what the step model prices (the
  linears' FLOPs and weights), so what ``conf/hardware/*.yaml`` takes;
* on the elementwise operators (norms, RoPE, activation, residual add), the bandwidth fraction they reach and a
  per-kernel floor (a kernel of a few rows takes its launch however little it moves): reported, since the step
  model does not price these kernels one by one (its ``step_overhead`` holds what they cost at small batches).

Only the rows of one GPU (``num_tensor_parallel_workers`` = 1) are used: their timings are of the whole
operator, which is what the cost model counts. ``emb`` (a gather, once per step) is not compared.

Used by ``experiments/fit_gpu_efficiencies.py``.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from nanovllm.harness.sim.hardware import Hardware
from nanovllm.harness.sim.operator_profile import LAYER_OPS, read_mlp_profile
from nanovllm.harness.sim.step_time import AnalyticalStepTime
from nanovllm.serving.monitor import ModelCost

# Token-count ranges the errors are reported by (inclusive upper bounds): decode-sized batches are launch- and
# bandwidth-bound, prefill-sized ones compute-bound, so one figure over all of them would hide either.
TOKEN_RANGES: tuple[tuple[int, float], ...] = ((1, 16), (17, 128), (129, 1024), (1025, 4096), (4097, math.inf))
# The rows comparing a whole layer's measured operators with the step model's roofline and with the kernels' sum.
LAYER_STEP, LAYER_KERNELS = "layer: step model", "layer: sum of kernels"


def range_label(low: int, high: float) -> str:
    return f">{low - 1}" if math.isinf(high) else f"{low}-{int(high)}"


@dataclass(frozen=True)
class Efficiencies:
    """What the fit sets: the hardware's two efficiencies and a per-kernel floor in seconds (0: none)."""

    flops_efficiency: float
    bandwidth_efficiency: float
    kernel_floor: float = 0.0


@dataclass(frozen=True)
class OperatorTimes:
    """One operator's measured medians: token counts and seconds, ascending in tokens."""

    op: str
    tokens: np.ndarray
    seconds: np.ndarray


@dataclass(frozen=True)
class ErrorRow:
    """The error of the analytical prediction against the measurements of ``op`` (or ``all operators``, ``LAYER_STEP``, ``LAYER_KERNELS``) over the
    token counts in ``tokens`` (a ``range_label`` or ``all``): ``n`` points, median and max of |pred/meas - 1|."""

    op: str
    tokens: str
    n: int
    median_pct: float
    max_pct: float


def read_operator_times(path: str | Path, cost: ModelCost) -> list[OperatorTimes]:
    """Every per-layer operator of the ``mlp.csv`` at ``path``, its one-GPU rows of ``cost``'s shape. Errors name
    the file: no such file, a missing column (the fit needs every one of ``LAYER_OPS``), no row of this shape."""
    path = Path(path)
    profile = read_mlp_profile(path, 1, cost)
    missing = [f"time_stats.{op}.median" for op in LAYER_OPS if op not in profile.layer]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} column(s) with measurements; fitting the hardware "
                         f"compares every layer operator ({', '.join(LAYER_OPS)})")
    times = []
    for op in LAYER_OPS:
        curve = profile.layer[op]
        # A median of 0 ms is under the profiler's 1 us resolution: no ratio to take the log of.
        keep = curve.y > 0
        times.append(OperatorTimes(op, curve.x[keep], curve.y[keep] / 1000.0))
    return times


def cost_from_profile(path: str | Path, bytes_per_element: int = 2) -> ModelCost:
    """A cost model of the shape of the first one-GPU row of the ``mlp.csv`` at ``path`` (``n_embd``,
    ``n_expanded_embd``, ``n_head``, ``n_kv_head``, ``vocab_size``): for profiles of models without a config
    here (the held-out check). Vidur profiles in float16: 2 bytes an element. Only SwiGLU MLPs
    (``use_gated_mlp`` true) are the cost model's; another is an error naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist (a Vidur mlp.csv)")
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        needed = ("n_embd", "n_expanded_embd", "n_head", "n_kv_head", "num_tensor_parallel_workers")
        missing = [c for c in needed if c not in header]
        if missing:
            raise ValueError(f"{path}: needs the column(s) {', '.join(missing)} to give the model's shape")
        row = next((r for r in reader if r["num_tensor_parallel_workers"].strip() == "1"), None)
    if row is None:
        raise ValueError(f"{path}: no row with num_tensor_parallel_workers=1")
    if row.get("use_gated_mlp", "True").strip().lower() not in ("true", "1"):
        raise ValueError(f"{path}: use_gated_mlp={row['use_gated_mlp']} (a two-matrix MLP); the cost model's "
                         "MLP is SwiGLU (gate, up, down)")
    hidden, heads = int(row["n_embd"]), int(row["n_head"])
    return ModelCost(hidden_size=hidden, intermediate_size=int(row["n_expanded_embd"]), num_layers=1,
                     num_heads=heads, num_kv_heads=int(row["n_kv_head"]), head_dim=hidden // heads,
                     vocab_size=int(row.get("vocab_size") or 0), tie_word_embeddings=False,
                     bytes_per_element=bytes_per_element)


def predict(times: list[OperatorTimes], cost: ModelCost, hardware: Hardware, dtype: str,
            efficiencies: Efficiencies, elementwise: Efficiencies | None = None) -> dict[str, np.ndarray]:
    """Seconds the analytical model gives each measured point, with ``hardware``'s efficiencies replaced by
    ``efficiencies`` -- for the elementwise operators by ``elementwise`` where given."""
    models = {}
    for e in {efficiencies, elementwise or efficiencies}:
        models[e] = AnalyticalStepTime(cost, dataclasses.replace(
            hardware, flops_efficiency=e.flops_efficiency, bandwidth_efficiency=e.bandwidth_efficiency), dtype)
    predicted = {}
    for t in times:
        e = efficiencies if elementwise is None or t.op in cost.layer_linear_shapes else elementwise
        predicted[t.op] = models[e].kernel_seconds(*cost.layer_operator_costs(t.tokens)[t.op], e.kernel_floor)
    return predicted


def fit(times: list[OperatorTimes], cost: ModelCost, hardware: Hardware, dtype: str,
        floor: bool = False) -> Efficiencies:
    """The efficiencies (in (0, 1]) and, with ``floor``, the per-kernel floor (0.1 to 1,000 us) that minimise the
    sum of squared log(predicted / measured) over the points of ``times`` (pass the matmuls or the elementwise
    operators: one set of values for both would fit neither), each token range weighing alike."""
    start = [math.log(hardware.flops_efficiency), math.log(hardware.bandwidth_efficiency)]
    low, high = [math.log(0.01)] * 2, [0.0, 0.0]
    if floor:
        start, low, high = start + [math.log(2e-6)], low + [math.log(1e-7)], high + [math.log(1e-3)]
    measured = np.concatenate([t.seconds for t in times])
    # Vidur measures 1, 2, 4, then every 8 to 256 tokens: 5 of its 259 counts are 16 or fewer. Each token range
    # weighs alike, or the fit would trade the decode-sized batches (most steps of a serving run) for the rest.
    tokens = np.concatenate([t.tokens for t in times])
    weight = np.zeros_like(tokens)
    for lo, hi in TOKEN_RANGES:
        inside = (tokens >= lo) & (tokens <= hi)
        weight[inside] = 1.0 / math.sqrt(inside.sum()) if inside.any() else 0.0

    def unpack(x: np.ndarray) -> Efficiencies:
        return Efficiencies(float(np.exp(x[0])), float(np.exp(x[1])), float(np.exp(x[2])) if floor else 0.0)

    def residuals(x: np.ndarray) -> np.ndarray:
        predicted = predict(times, cost, hardware, dtype, unpack(x))
        return weight * np.log(np.concatenate([predicted[t.op] for t in times]) / measured)

    # Started from the hardware's own values; the bounds keep the efficiencies in (0, 1], which Hardware requires.
    result = least_squares(residuals, np.clip(start, low, high), bounds=(low, high))
    return unpack(result.x)


def errors(times: list[OperatorTimes], cost: ModelCost, hardware: Hardware, dtype: str,
           efficiencies: Efficiencies, elementwise: Efficiencies | None = None) -> list[ErrorRow]:
    """The error table of ``predict``'s times: per operator and token range, per operator over all ranges, all
    operators per range, and two rows of a whole layer at the token counts every operator was measured at, the
    measured operators added up against (``LAYER_STEP``) the step model's roofline of the layer's linears
    (``AnalyticalStepTime.predict``'s formula: the linears' FLOPs and weights at ``efficiencies``, no
    elementwise kernels, no floor) and (``LAYER_KERNELS``) the sum of the kernels' predicted times."""
    predicted = predict(times, cost, hardware, dtype, efficiencies, elementwise)
    ratios = {t.op: (t.tokens, predicted[t.op] / t.seconds - 1.0) for t in times}
    common = sorted(set.intersection(*(set(t.tokens.tolist()) for t in times))) if times else []
    if common:
        tokens = np.asarray(common, dtype=float)
        measured = sum(np.interp(tokens, t.tokens, t.seconds) for t in times)
        kernels = sum(np.interp(tokens, t.tokens, predicted[t.op]) for t in times)
        model = AnalyticalStepTime(cost, dataclasses.replace(
            hardware, flops_efficiency=efficiencies.flops_efficiency,
            bandwidth_efficiency=efficiencies.bandwidth_efficiency), dtype)
        params = cost.linear_params_per_layer
        step = model.kernel_seconds(2 * params * tokens, params * cost.bytes_per_element + 0 * tokens)
        ratios[LAYER_STEP] = (tokens, step / measured - 1.0)
        ratios[LAYER_KERNELS] = (tokens, kernels / measured - 1.0)
    rows = []
    ranges = [(range_label(lo, hi), lo, hi) for lo, hi in TOKEN_RANGES]
    for op, (tokens, ratio) in ratios.items():
        for label, lo, hi in ranges:
            rows.append(_row(op, label, ratio[(tokens >= lo) & (tokens <= hi)]))
        rows.append(_row(op, "all", ratio))
    operators = [(t, r) for op, (t, r) in ratios.items() if op in LAYER_OPS]
    for label, lo, hi in [*ranges, ("all", 1, math.inf)]:
        rows.append(_row("all operators", label, np.concatenate([r[(t >= lo) & (t <= hi)] for t, r in operators])))
    return [r for r in rows if r.n]


def _row(op: str, tokens: str, ratio: np.ndarray) -> ErrorRow:
    if not len(ratio):
        return ErrorRow(op, tokens, 0, math.nan, math.nan)
    pct = 100 * np.abs(ratio)
    return ErrorRow(op, tokens, len(ratio), float(np.median(pct)), float(pct.max()))
