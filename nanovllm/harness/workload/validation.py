"""Workload config checks: every bad value raises ``ValueError`` naming the field (as a Hydra override
would spell it), the value and what is allowed. The config dataclasses and the Hydra ``DictConfig`` of the same
fields go through the same checks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

from nanovllm.harness.workload.distributions import LENGTH_KINDS, _zipf_scale

PROMPT_KINDS = ("random", "text")
WORKLOAD_NAMES = ("synthetic", "chat", "trace", "multi_turn")
TRACE_FORMATS = ("auto", "jsonl", "mooncake", "sharegpt", "azure", "vidur", "burstgpt")
ZERO_TOKEN_POLICIES = ("skip", "one", "error")  # CSV traces: rows with 0 prompt or output tokens


def _bad(field_name: str, value: Any, allowed: str) -> ValueError:
    """An error naming the field (as a Hydra override would), the bad value and what is allowed."""
    return ValueError(f"workload.{field_name}={value!r} is invalid: {allowed}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_int(cfg: Any, name: str, lo: int) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise _bad(name, value, f"must be an integer >= {lo}")


def _check_arrivals(cfg: Any) -> None:
    rate, shape = cfg.request_rate, cfg.burstiness
    if not _is_number(rate) or math.isnan(rate) or rate <= 0:
        raise _bad("request_rate", rate, "must be > 0 requests/s, or inf to send every request at t=0")
    if not _is_number(shape) or not math.isfinite(shape) or shape <= 0:
        raise _bad("burstiness", shape, "must be a finite number > 0 (1 = Poisson, <1 burstier, >1 steadier)")


def _check_shares(field_name: str, shares: Sequence[float], expected_len: int, len_field: str) -> None:
    """Weights must match their classes one to one, be non-negative and not all zero."""
    if len(shares) != expected_len:
        raise _bad(field_name, shares, f"must have one weight per entry of {len_field} ({expected_len})")
    if any(not _is_number(w) or not math.isfinite(w) or w < 0 for w in shares):
        raise _bad(field_name, shares, "weights must be finite numbers >= 0")
    if sum(shares) <= 0:
        raise _bad(field_name, shares, "at least one weight must be > 0")


def _check_classes(cfg: Any) -> None:
    classes = list(cfg.priority_classes)
    if not classes or any(not isinstance(c, int) or isinstance(c, bool) for c in classes):
        raise _bad("priority_classes", classes, "must be a non-empty list of integers")
    _check_shares("priority_weights", list(cfg.priority_weights), len(classes), "priority_classes")
    _check_int(cfg, "num_clients", 1)
    shares = getattr(cfg, "client_rate_shares", None)
    if shares is not None:
        _check_shares("client_rate_shares", list(shares), cfg.num_clients, "num_clients")
    for slo_field in ("ttft_slo_ms", "e2el_slo_ms"):
        targets = getattr(cfg, slo_field, None)
        if targets is None:
            continue
        if len(targets) != len(classes) or any(not _is_number(t) or not t > 0 for t in targets):
            raise _bad(slo_field, list(targets), f"must be one target in ms > 0 per entry of priority_classes "
                                                 f"({len(classes)}), or null")


def _check_length(dist: Any, where: str) -> None:
    kind = dist.kind
    if kind not in LENGTH_KINDS:
        raise _bad(f"{where}.kind", kind, f"must be one of {', '.join(LENGTH_KINDS)}")
    lo, hi, mean = dist.min, dist.max, dist.mean
    if not isinstance(lo, int) or lo < 1:
        raise _bad(f"{where}.min", lo, "must be an integer >= 1")
    if not isinstance(hi, int) or hi < lo:
        raise _bad(f"{where}.max", hi, f"must be an integer >= {where}.min ({lo}); the range is empty")
    if not _is_number(mean) or not lo <= mean <= hi:
        raise _bad(f"{where}.mean", mean, f"must lie in [{where}.min, {where}.max] = [{lo}, {hi}]")
    if kind == "uniform" and not (_is_number(dist.range_ratio) and 0 <= dist.range_ratio < 1):
        raise _bad(f"{where}.range_ratio", dist.range_ratio, "must be in [0, 1)")
    if kind == "lognormal" and not (_is_number(dist.sigma) and math.isfinite(dist.sigma) and dist.sigma >= 0):
        raise _bad(f"{where}.sigma", dist.sigma, "must be a finite number >= 0")
    if kind == "zipf":
        _check_zipf(dist, where)


def _check_zipf(dist: Any, where: str) -> None:
    if not (_is_number(dist.alpha) and math.isfinite(dist.alpha) and dist.alpha > 1):
        raise _bad(f"{where}.alpha", dist.alpha, "must be a finite number > 1 (Zipf needs alpha > 1)")
    if dist.min < dist.mean < dist.max:
        try:  # solving the scale now means an unreachable mean fails at config time, not mid-run
            _zipf_scale(float(dist.alpha), float(dist.mean), int(dist.min), int(dist.max))
        except ValueError as e:
            raise _bad(f"{where}.alpha", dist.alpha, str(e)) from None


def _check_seed(cfg: Any) -> None:
    _check_int(cfg, "seed", 0)  # numpy's SeedSequence rejects negative seeds


def _check_seconds(cfg: Any, name: str) -> None:
    value = getattr(cfg, name)
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise _bad(name, value, "must be a finite number of seconds >= 0")


def _check_prefix_pair(cfg: Any, count_field: str, len_field: str) -> None:
    """Shared prefixes: a count and a length, both 0 or both >= 1."""
    _check_int(cfg, count_field, 0)
    _check_int(cfg, len_field, 0)
    # A prefix length without groups (or groups without a prefix) is almost surely a typo: say so.
    if getattr(cfg, count_field) > 0 and getattr(cfg, len_field) == 0:
        raise _bad(len_field, 0, f"must be >= 1 when {count_field} > 0")
    if getattr(cfg, len_field) > 0 and getattr(cfg, count_field) == 0:
        raise _bad(count_field, 0, f"must be >= 1 when {len_field} > 0")


def _validate_synthetic(cfg: Any, check_files: bool) -> None:
    _check_int(cfg, "num_requests", 1)
    _check_arrivals(cfg)
    _check_length(cfg.input_len, "input_len")
    _check_length(cfg.output_len, "output_len")
    if cfg.prompt_kind not in PROMPT_KINDS:
        raise _bad("prompt_kind", cfg.prompt_kind, f"must be one of {', '.join(PROMPT_KINDS)}")
    _check_prefix_pair(cfg, "num_prefix_groups", "prefix_len")
    _check_classes(cfg)
    _check_seed(cfg)


def _validate_multi_turn(cfg: Any, check_files: bool) -> None:
    _check_int(cfg, "num_sessions", 1)
    _check_arrivals(cfg)
    _check_length(cfg.turns, "turns")
    _check_length(cfg.user_len, "user_len")
    _check_length(cfg.reply_len, "reply_len")
    _check_seconds(cfg, "think_time_s")
    _check_seconds(cfg, "reply_time_per_token_s")
    if getattr(cfg, "working_set_tokens", None) is not None:
        _check_int(cfg, "working_set_tokens", 1)
        if not math.isfinite(cfg.request_rate):
            raise _bad("request_rate", cfg.request_rate, "must be finite with working_set_tokens (turns arrive "
                       "at that rate)")
    if getattr(cfg, "tool_output_len", None) is not None:
        _check_length(cfg.tool_output_len, "tool_output_len")
    if cfg.prompt_kind not in PROMPT_KINDS:
        raise _bad("prompt_kind", cfg.prompt_kind, f"must be one of {', '.join(PROMPT_KINDS)}")
    _check_prefix_pair(cfg, "num_system_prompts", "system_len")
    _check_classes(cfg)
    _check_seed(cfg)


def _validate_chat(cfg: Any, check_files: bool) -> None:
    _check_int(cfg, "num_requests", 1)
    _check_arrivals(cfg)
    _check_int(cfg, "max_tokens", 1)
    _check_classes(cfg)
    _check_seed(cfg)


def _validate_trace(cfg: Any, check_files: bool) -> None:
    if cfg.format not in TRACE_FORMATS:
        raise _bad("format", cfg.format, f"must be one of {', '.join(TRACE_FORMATS)}")
    if not _is_number(cfg.time_scale) or not math.isfinite(cfg.time_scale) or cfg.time_scale < 0:
        raise _bad("time_scale", cfg.time_scale, "must be a finite number >= 0")
    if cfg.max_requests is not None:
        _check_int(cfg, "max_requests", 1)
    _check_int(cfg, "default_output_len", 1)
    _check_int(cfg, "block_size", 1)
    _check_arrivals(cfg)
    _check_seed(cfg)
    _check_csv_options(cfg)
    if check_files:
        _check_trace_path(cfg.path, cfg.format)


def _check_csv_options(cfg: Any) -> None:
    """The CSV traces' options (a config without them, built before they existed, reads as their defaults)."""
    zero = getattr(cfg, "zero_tokens", "skip")
    if zero not in ZERO_TOKEN_POLICIES:
        raise _bad("zero_tokens", zero, f"must be one of {', '.join(ZERO_TOKEN_POLICIES)}")
    for key in ("models", "log_types"):
        values = getattr(cfg, key, None)
        if values is not None and (isinstance(values, str) or not values
                                   or not all(isinstance(v, str) and v for v in values)):
            raise _bad(key, values, "must be null or a non-empty list of names, e.g. [ChatGPT] (BurstGPT only)")


def _check_trace_path(path: str, trace_format: str) -> None:
    if not path:
        raise _bad("path", path, "a trace workload needs the path of a .jsonl trace (nano-vllm's or Mooncake's), "
                                 "a ShareGPT .json file or a .csv trace (Azure's, Vidur's or BurstGPT's)")
    p = Path(path).expanduser()
    # Only format=auto goes by the name; a named format reads whatever the file is called.
    if trace_format == "auto" and p.suffix not in (".jsonl", ".json", ".csv"):
        raise _bad("path", path, "must end in .jsonl (trace with arrival times, or Mooncake's), .json "
                                 "(ShareGPT) or .csv (Azure, Vidur or BurstGPT), or set workload.format")
    if not p.is_file():
        raise _bad("path", path, "no such file")


_VALIDATORS: dict[str, Callable[[Any, bool], None]] = {
    "synthetic": _validate_synthetic, "chat": _validate_chat, "trace": _validate_trace,
    "multi_turn": _validate_multi_turn,
}


def validate_workload_config(cfg: Any, check_files: bool = True) -> None:
    """Raise ``ValueError`` naming the field, its bad value and what is allowed, if ``cfg`` is invalid.

    ``cfg`` is one of the config dataclasses or a ``DictConfig`` with the same fields. ``check_files=False``
    skips the trace file's existence check (used while a config object is still being built).
    """
    name = cfg.name
    if name not in _VALIDATORS:
        raise _bad("name", name, f"must be one of {', '.join(WORKLOAD_NAMES)}")
    _VALIDATORS[name](cfg, check_files)
