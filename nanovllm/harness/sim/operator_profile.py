"""Operator timings measured on real GPUs, in Vidur's profile format, as curves the ``profiled`` step-time model
(``nanovllm.harness.sim.step_time.ProfiledStepTime``) adds up.

Vidur (https://github.com/microsoft/vidur) publishes per-operator timings of Llama-family models, per GPU and model:
``data/profiling/compute/<gpu>/<org>/<model>/mlp.csv`` (e.g. ``h100/meta-llama/Llama-2-7b-hf``) and, where
measured, ``attention.csv`` beside it. The files are not shipped here; ``runner.profile`` names such a directory.

``mlp.csv``: one row per (model shape, tensor-parallel degree, token count): ``n_head, n_kv_head, n_embd,
n_expanded_embd, num_tokens, num_tensor_parallel_workers`` and, per operator, ``time_stats.<op>.median`` in
milliseconds for one layer on one rank (``mlp_up_proj``, ``mlp_act``, ``mlp_down_proj``, ``attn_pre_proj``,
``attn_rope``, ``attn_post_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``add``; ``emb``, the
embedding, once per step). ``attention.csv``: rows of ``n_embd, n_q_head, n_kv_head,
num_tensor_parallel_workers, batch_size, prefill_chunk_size, kv_cache_size, is_prefill`` and
``time_stats.attn_prefill.median`` (prefill rows) / ``time_stats.attn_decode.median`` (decode rows).

Each operator becomes a :class:`Curve` over its size (tokens; for attention the (query, key) pairs of a prefill or
the KV tokens a decode batch reads): linear between measured points, the measured median where a size was
measured several times. Below the smallest measured size the smallest size's time (a kernel launch costs what it
costs however few the tokens); above the largest, time proportional to size from the largest point (the
throughput-bound regime a large batch is in). An empty cell is an operator not measured in that row. Every
problem names the file and the line.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

# The per-layer operators of Vidur's mlp.csv the model adds up (each once per layer, as Vidur's predictor does).
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
STEP_OPS = ("emb",)  # once per step, not per layer
TP_COLUMN = "num_tensor_parallel_workers"


def _time_column(op: str) -> str:
    return f"time_stats.{op}.median"


def _error(path: Path, lineno: int, what: str) -> ValueError:
    return ValueError(f"{path}:{lineno}: {what}")


@dataclass(frozen=True)
class Curve:
    """Milliseconds as a function of an operator's size, from measured points (see the module docstring)."""

    x: np.ndarray   # sizes, ascending, unique, > 0
    y: np.ndarray   # milliseconds at each size

    @classmethod
    def from_points(cls, points: Iterable[tuple[float, float]]) -> "Curve":
        """From ``(size, ms)`` points in any order; repeated sizes give their median."""
        by_x: dict[float, list[float]] = {}
        for x, y in points:
            by_x.setdefault(float(x), []).append(float(y))
        xs = sorted(x for x in by_x if x > 0)
        if not xs:
            raise ValueError("no measured point with a size > 0")
        return cls(np.asarray(xs), np.asarray([float(np.median(by_x[x])) for x in xs]))

    def __call__(self, size: float) -> float:
        if size <= 0:
            return 0.0
        if size > self.x[-1]:
            return float(self.y[-1] * size / self.x[-1])
        return float(np.interp(size, self.x, self.y))  # np.interp holds y[0] below x[0]


def _rows(path: Path) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """The header and ``(line number, row)`` of each non-blank row of a CSV profile."""
    if not path.is_file():
        raise ValueError(f"runner.profile: {path} does not exist (a Vidur profile directory holds mlp.csv and, "
                         "optionally, attention.csv)")
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        rows = [(reader.line_num, row) for row in reader if any((v or "").strip() for v in row.values())]
        header = list(reader.fieldnames or [])
    if not header:
        raise ValueError(f"{path}: empty profile (no header line)")
    return header, rows


def _number(row: Mapping[str, str], column: str, path: Path, lineno: int) -> float | None:
    """A cell as a number; None when empty (not measured)."""
    cell = (row.get(column) or "").strip()
    if not cell:
        return None
    try:
        value = float(cell)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise _error(path, lineno, f"'{column}' must be a number >= 0, got {cell!r}")
    return value


def _required(row: Mapping[str, str], column: str, path: Path, lineno: int) -> float:
    value = _number(row, column, path, lineno)
    if value is None:
        raise _error(path, lineno, f"'{column}' is empty")
    return value


def _select(path: Path, header: list[str], rows: list[tuple[int, dict[str, str]]], tp: int,
            shape: Mapping[str, int]) -> list[tuple[int, dict[str, str]]]:
    """The rows of this tensor-parallel degree and model shape (the columns of ``shape`` the file has)."""
    if TP_COLUMN not in header and tp != 1:
        raise ValueError(f"{path}: has no '{TP_COLUMN}' column (one GPU's timings); this run has "
                         f"engine.tensor_parallel_size={tp}")
    wanted = {column: value for column, value in shape.items() if column in header}
    if TP_COLUMN in header:
        wanted[TP_COLUMN] = tp
    kept, seen = [], set()
    for lineno, row in rows:
        values = tuple((column, _required(row, column, path, lineno)) for column in wanted)
        seen.add(values)
        if all(v == wanted[column] for column, v in values):
            kept.append((lineno, row))
    if not kept:
        found = "; ".join(", ".join(f"{c}={v:g}" for c, v in values) for values in sorted(seen)[:8])
        ours = ", ".join(f"{c}={v}" for c, v in wanted.items())
        raise ValueError(f"{path}: no row is of this run's model and tensor-parallel degree ({ours}); the file has "
                         f"{found or 'no rows'}. Profile this model (Vidur's profiling scripts) or pick its "
                         "directory")
    return kept


def _curve(points: list[tuple[float, float]], what: str, path: Path) -> Curve:
    try:
        return Curve.from_points(points)
    except ValueError as e:
        raise ValueError(f"{path}: {what}: {e}") from None


@dataclass(frozen=True)
class LinearProfile:
    """The per-layer operators of ``mlp.csv`` (``layer``) and the once-per-step ones (``step``), by token count."""

    layer: dict[str, Curve]
    step: dict[str, Curve]
    max_tokens: int

    def layer_ms(self, tokens: int) -> float:
        return sum(curve(tokens) for curve in self.layer.values())

    def step_ms(self, tokens: int) -> float:
        return sum(curve(tokens) for curve in self.step.values())


def read_mlp_profile(path: Path, tp: int, cost: Any) -> LinearProfile:
    """The curves of ``mlp.csv``'s rows for ``cost``'s model shape (``ModelCost``) at ``tp`` ranks."""
    header, rows = _rows(path)
    if "num_tokens" not in header:
        raise _error(path, 1, "a Vidur mlp.csv needs a 'num_tokens' column")
    present = [op for op in (*LAYER_OPS, *STEP_OPS) if _time_column(op) in header]
    if not any(op in LAYER_OPS for op in present):
        raise _error(path, 1, f"no per-layer operator timings (time_stats.<op>.median for any of "
                              f"{', '.join(LAYER_OPS)})")
    shape = {"n_embd": cost.hidden_size, "n_expanded_embd": cost.intermediate_size, "n_head": cost.num_heads,
             "n_kv_head": cost.num_kv_heads}
    points: dict[str, list[tuple[float, float]]] = {op: [] for op in present}
    max_tokens = 0
    for lineno, row in _select(path, header, rows, tp, shape):
        tokens = _required(row, "num_tokens", path, lineno)
        max_tokens = max(max_tokens, int(tokens))
        for op in present:
            ms = _number(row, _time_column(op), path, lineno)
            if ms is not None:
                points[op].append((tokens, ms))
    curves = {op: _curve(p, _time_column(op), path) for op, p in points.items() if p}
    return LinearProfile(layer={op: c for op, c in curves.items() if op in LAYER_OPS},
                         step={op: c for op, c in curves.items() if op in STEP_OPS}, max_tokens=max_tokens)


def _is_prefill(row: Mapping[str, str], path: Path, lineno: int) -> bool:
    cell = (row.get("is_prefill") or "").strip().lower()
    if cell not in ("true", "false", "1", "0"):
        raise _error(path, lineno, f"'is_prefill' must be True or False, got {row.get('is_prefill')!r}")
    return cell in ("true", "1")


@dataclass(frozen=True)
class AttentionProfile:
    """Attention's kernel time per layer: prefill by (query, key) pairs, decode by KV tokens read."""

    prefill: Curve
    decode: Curve


def read_attention_profile(path: Path, tp: int, cost: Any) -> AttentionProfile:
    """The prefill and decode curves of ``attention.csv``'s rows for ``cost``'s model shape at ``tp`` ranks.
    A prefill row of ``batch_size`` chunks of ``prefill_chunk_size`` tokens after ``kv_cache_size`` cached ones
    attends ``batch_size * (chunk * cached + chunk * (chunk + 1) / 2)`` pairs (the causal mask, as the engine
    counts ``attn_pairs``); a decode row of ``batch_size`` sequences of ``kv_cache_size`` tokens reads
    ``batch_size * kv_cache_size`` KV tokens."""
    header, rows = _rows(path)
    needed = ("is_prefill", "batch_size", "prefill_chunk_size", "kv_cache_size")
    missing = [c for c in needed if c not in header]
    if missing:
        raise _error(path, 1, f"a Vidur attention.csv needs the column(s) {', '.join(missing)}")
    shape = {"n_embd": cost.hidden_size, "n_q_head": cost.num_heads, "n_kv_head": cost.num_kv_heads}
    prefill: list[tuple[float, float]] = []
    decode: list[tuple[float, float]] = []
    for lineno, row in _select(path, header, rows, tp, shape):
        batch = _required(row, "batch_size", path, lineno)
        cached = _required(row, "kv_cache_size", path, lineno)
        if _is_prefill(row, path, lineno):
            chunk = _required(row, "prefill_chunk_size", path, lineno)
            ms = _number(row, _time_column("attn_prefill"), path, lineno)
            if ms is not None:
                prefill.append((batch * (chunk * cached + chunk * (chunk + 1) / 2), ms))
        else:
            ms = _number(row, _time_column("attn_decode"), path, lineno)
            if ms is not None:
                decode.append((batch * cached, ms))
    return AttentionProfile(prefill=_curve(prefill, "prefill rows (time_stats.attn_prefill.median)", path),
                            decode=_curve(decode, "decode rows (time_stats.attn_decode.median)", path))


def split_attention(features: Mapping[str, int]) -> tuple[float, float]:
    """``(prefill pairs, decode KV tokens)`` of a step, from the features the engine records (which add prefill
    and decode up). A decode of a sequence with context ``c`` attends ``c`` pairs and reads ``c`` KV tokens, so
    with ``D`` the decodes' KV tokens, ``K`` the prefills' cached tokens and ``n`` their new ones, ``context_tokens
    = K + n + D``; with ``p`` prefill sequences of equal chunks and cached lengths, ``attn_pairs = n K / p +
    n (n / p + 1) / 2 + D``, which solves for ``D`` -- exactly for one prefill sequence (a chunked prefill), an
    estimate for several, clamped to what is possible."""
    n, p = features["num_prefill_tokens"], features["num_prefill_seqs"]
    decodes, context, pairs = features["num_decode_seqs"], features["context_tokens"], features["attn_pairs"]
    if n == 0 or p == 0:
        return 0.0, float(pairs)
    if decodes == 0:
        return float(pairs), 0.0
    per_seq = n / p
    if per_seq > 1:
        d = (n * (context - n) / p + n * (per_seq + 1) / 2 - pairs) / (per_seq - 1)
    else:  # single-token prefills: pairs and context carry the same information; split by sequences
        d = (context - n) * decodes / (decodes + p)
    d = min(max(d, float(decodes)), float(context - n))
    return float(pairs) - d, d
