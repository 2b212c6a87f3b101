"""Recorded workloads: a JSONL trace with its own arrival times, or a ShareGPT JSON file (arrivals
synthesised). Every problem in a file names the file and the line or entry."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from nanovllm.harness.workload.config import WorkloadRequest
from nanovllm.harness.workload.distributions import _rng, sample_arrival_times
from nanovllm.harness.workload.prompts import _normal_token_ids, _random_tokens
from nanovllm.harness.workload.validation import _is_number


# The fields of a JSONL trace line: arrival_time and one of prompt / prompt_len are required.
TRACE_FIELDS = ("arrival_time", "prompt", "prompt_len", "output_len", "priority", "client_id", "request_id")


def _line_error(path: Path, lineno: int, what: str) -> ValueError:
    return ValueError(f"{path}:{lineno}: {what}")


def _get_int(obj: dict, key: str, lo: int | None, path: Path, lineno: int, default: int | None = None) -> int:
    """An integer field of a trace line (``lo=None``: any integer)."""
    value = obj.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or (lo is not None and value < lo):
        allowed = "an integer" if lo is None else f"an integer >= {lo}"
        raise _line_error(path, lineno, f"'{key}' must be {allowed}, got {value!r}")
    return value


def _parse_trace_line(obj: Any, path: Path, lineno: int, cfg: Any, token_ids: np.ndarray,
                      rng: np.random.Generator) -> WorkloadRequest:
    """One JSONL object -> a request; every problem names the file and (1-based) line."""
    if not isinstance(obj, dict):
        raise _line_error(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(TRACE_FIELDS))
    if unknown:  # a misspelt field (output_length) would silently fall back to its default
        raise _line_error(path, lineno, f"unknown field(s) {', '.join(map(repr, unknown))}; a trace line has "
                                        f"{', '.join(TRACE_FIELDS)}")
    t = obj.get("arrival_time")
    if not _is_number(t) or not math.isfinite(t) or t < 0:
        raise _line_error(path, lineno, f"'arrival_time' must be a number of seconds >= 0, got {t!r}")
    if "prompt" in obj:
        prompt: str | list[int] = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise _line_error(path, lineno, f"'prompt' must be a non-empty string, got {prompt!r}")
    elif "prompt_len" in obj:
        prompt = _random_tokens(token_ids, _get_int(obj, "prompt_len", 1, path, lineno), rng)
    else:
        raise _line_error(path, lineno, "needs 'prompt' (text) or 'prompt_len' (number of random tokens)")
    client = obj.get("client_id")
    if client is not None and not isinstance(client, str):
        raise _line_error(path, lineno, f"'client_id' must be a string, got {client!r}")
    request_id = obj.get("request_id")
    if request_id is not None and (not isinstance(request_id, (str, int)) or isinstance(request_id, bool)):
        raise _line_error(path, lineno, f"'request_id' must be a string or an integer, got {request_id!r}")
    return WorkloadRequest(
        arrival_time=float(t) * cfg.time_scale, prompt=prompt,
        max_tokens=_get_int(obj, "output_len", 1, path, lineno, default=cfg.default_output_len),
        priority=_get_int(obj, "priority", None, path, lineno, default=0), client_id=client,
        ignore_eos=bool(cfg.ignore_eos), request_id=None if request_id is None else str(request_id))


def jsonl_objects(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed object)`` of each non-blank line of a JSONL file, each line parsed only when it is
    taken (a reader that stops after ``max_requests`` never parses the rest)."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # file lines only (not str.splitlines's set)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}); is it really a JSONL trace?") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _line_error(path, lineno, f"invalid JSON ({e.msg} at column {e.colno})") from None
        yield lineno, obj


def read_jsonl_trace(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    """Requests of a JSONL trace (blank lines skipped), in file order, at most ``cfg.max_requests``."""
    path = Path(cfg.path).expanduser()
    token_ids = _normal_token_ids(tokenizer)
    rng = _rng(cfg.seed, "prompts")
    out: list[WorkloadRequest] = []
    first_line_of: dict[str, int] = {}
    for lineno, obj in jsonl_objects(path):
        request = _parse_trace_line(obj, path, lineno, cfg, token_ids, rng)
        if request.request_id is not None:
            # The engine, the policies and abort_request find a request by its id: two would be confused.
            if request.request_id in first_line_of:
                raise _line_error(path, lineno, f"'request_id' {request.request_id!r} repeats line "
                                                f"{first_line_of[request.request_id]}; ids must be unique")
            first_line_of[request.request_id] = lineno
        out.append(request)
        if cfg.max_requests is not None and len(out) >= cfg.max_requests:
            break  # before the next line is taken: lines past the last one kept are never parsed
    return out


_HUMAN, _GPT = ("human", "user"), ("gpt", "assistant", "chatgpt")


def _sharegpt_pair(entry: Any, path: Path, index: int) -> tuple[str, str] | None:
    """(first human turn, the reply after it) of one ShareGPT entry; None when it has no such pair."""
    convs = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(convs, list):
        raise ValueError(f"{path}: entry {index} must be an object with a 'conversations' list")
    for turn, reply in zip(convs, convs[1:]):
        if not isinstance(turn, dict) or not isinstance(reply, dict):
            raise ValueError(f"{path}: entry {index}: each turn must be an object with 'from' and 'value'")
        if turn.get("from") in _HUMAN and reply.get("from") in _GPT:
            if isinstance(turn.get("value"), str) and isinstance(reply.get("value"), str) and turn["value"]:
                return turn["value"], reply["value"]
            return None
    return None


def read_sharegpt(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    """ShareGPT JSON: first human turn -> prompt, the reply's token count -> max_tokens; synthetic arrivals.

    Entries without a human turn followed by a reply are skipped (real ShareGPT dumps contain many);
    the first ``max_requests`` usable entries are kept, in file order.
    """
    path = Path(cfg.path).expanduser()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file must hold a JSON list of conversations")
    pairs: list[tuple[str, str]] = []
    for index, entry in enumerate(data):
        if cfg.max_requests is not None and len(pairs) >= cfg.max_requests:
            break
        pair = _sharegpt_pair(entry, path, index)
        if pair is not None:
            pairs.append(pair)
    arrivals = sample_arrival_times(len(pairs), cfg.request_rate, cfg.burstiness, _rng(cfg.seed, "arrivals"))
    return [
        WorkloadRequest(arrival_time=float(t) * cfg.time_scale, prompt=prompt,
                        max_tokens=max(1, len(tokenizer.encode(reply, add_special_tokens=False))),
                        ignore_eos=bool(cfg.ignore_eos))
        for t, (prompt, reply) in zip(arrivals, pairs)
    ]
