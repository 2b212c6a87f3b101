"""Mooncake traces: replay the request traces Moonshot AI released with Mooncake (FAST'25; the files in
``FAST25-release/traces`` of https://github.com/kvcache-ai/Mooncake), or any trace in their format.

Each JSONL line is one request::

    {"timestamp": 3052, "input_length": 2287, "output_length": 316, "hash_ids": [0, 42, 43, 44, 45]}

``timestamp`` is its arrival in milliseconds from the trace's start, ``input_length`` and ``output_length`` its
token counts, ``hash_ids`` one id per ``block_size``-token block of the prompt (512 in Mooncake's traces; the last
block may be partial). Equal ids mean equal block content -- a trace's ids hash the prefix up to the block, so
equal ids at a position mean a shared prefix -- which is all a trace says about the prompts (the text is not
released). The same reading is what AIPerf (``--custom-dataset-type mooncake_trace``) and NVIDIA Dynamo's
trace tools do.

Prompts are synthesised so that the reuse is real: block i of a prompt is ``block_size`` random token ids drawn
from a generator seeded by ``(seed, hash_id)`` alone, the last block cut to ``input_length``; two requests with
the same id at a position therefore share those tokens exactly, whichever came first, and a prefix cache or a
cache-aware router sees the trace's hits. A line without ``hash_ids`` gets tokens of its own (no reuse). A line
may carry a ``session_id`` (string or integer; not in the FAST'25 files, some traces derived from them add it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from nanovllm.harness.workload.config import WorkloadRequest
from nanovllm.harness.workload.distributions import _rng
from nanovllm.harness.workload.prompts import _normal_token_ids, _random_tokens
from nanovllm.harness.workload.traces import _get_int, _line_error, jsonl_objects
from nanovllm.harness.workload.validation import _is_number

MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids", "session_id")
# Fields only a Mooncake line has (the nano-vllm JSONL trace says arrival_time / prompt / prompt_len).
_SIGNATURE = ("timestamp", "input_length", "hash_ids")


def looks_like_mooncake(obj: Any) -> bool:
    """Whether a trace line is in Mooncake's format (``workload.format=auto`` asks the first line)."""
    return isinstance(obj, dict) and any(key in obj for key in _SIGNATURE)


class _Blocks:
    """The tokens of each hash id, drawn once per id (``block_size`` of them) and kept for the trace's other
    requests: the generator is seeded by the id, so the content never depends on which request met it first."""

    def __init__(self, seed: int, block_size: int, token_ids: np.ndarray) -> None:
        self.seed, self.block_size, self.token_ids = seed, block_size, token_ids
        self._tokens: dict[int, list[int]] = {}

    def __call__(self, hash_id: int) -> list[int]:
        tokens = self._tokens.get(hash_id)
        if tokens is None:
            rng = _rng(self.seed, "trace_blocks", hash_id)
            tokens = self._tokens[hash_id] = _random_tokens(self.token_ids, self.block_size, rng)
        return tokens


def _hash_ids(obj: dict, input_length: int, block_size: int, path: Path, lineno: int) -> list[int] | None:
    """The line's block ids, checked: integers >= 0, one per ``block_size`` block of ``input_length`` tokens."""
    ids = obj.get("hash_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or any(not isinstance(h, int) or isinstance(h, bool) or h < 0 for h in ids):
        raise _line_error(path, lineno, f"'hash_ids' must be a list of integers >= 0, got {ids!r}")
    blocks = math.ceil(input_length / block_size)
    if len(ids) != blocks:
        # Mooncake's own traces always agree; a mismatch is a different block size (or a damaged line).
        raise _line_error(path, lineno, f"'hash_ids' has {len(ids)} block id(s) but 'input_length' {input_length} "
                                        f"makes {blocks} block(s) of workload.block_size={block_size} tokens; "
                                        "set workload.block_size to the trace's block size")
    return ids


def _prompt(ids: list[int], input_length: int, blocks: Callable[[int], list[int]]) -> list[int]:
    """The prompt of these block ids: their blocks end to end, cut to ``input_length``."""
    prompt: list[int] = []
    for hash_id in ids:
        prompt += blocks(hash_id)
    return prompt[:input_length]  # the last block is partial: its first tokens, the same for every request


def _parse_mooncake_line(obj: Any, path: Path, lineno: int, cfg: Any, blocks: _Blocks,
                         rng: np.random.Generator) -> WorkloadRequest:
    """One Mooncake JSONL object -> a request; every problem names the file and (1-based) line."""
    if not isinstance(obj, dict):
        raise _line_error(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(MOONCAKE_FIELDS))
    if unknown:  # a misspelt hash_ids would silently make every prompt unique
        raise _line_error(path, lineno, f"unknown field(s) {', '.join(map(repr, unknown))}; a Mooncake trace line "
                                        f"has {', '.join(MOONCAKE_FIELDS)}")
    t = obj.get("timestamp")
    if not _is_number(t) or not math.isfinite(t) or t < 0:
        raise _line_error(path, lineno, f"'timestamp' must be a number of milliseconds >= 0, got {t!r}")
    input_length = _get_int(obj, "input_length", 1, path, lineno)
    ids = _hash_ids(obj, input_length, cfg.block_size, path, lineno)
    prompt = (_random_tokens(blocks.token_ids, input_length, rng) if ids is None
              else _prompt(ids, input_length, blocks))
    session = obj.get("session_id")
    if session is not None and (not isinstance(session, (str, int)) or isinstance(session, bool)):
        raise _line_error(path, lineno, f"'session_id' must be a string or an integer, got {session!r}")
    return WorkloadRequest(
        arrival_time=float(t) / 1000.0 * cfg.time_scale, prompt=prompt,
        max_tokens=_get_int(obj, "output_length", 1, path, lineno, default=cfg.default_output_len),
        ignore_eos=bool(cfg.ignore_eos), session_id=None if session is None else str(session))


def read_mooncake_trace(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    """Requests of a Mooncake trace (blank lines skipped), in file order, at most ``cfg.max_requests``; arrivals
    are ``timestamp / 1000 * time_scale`` seconds."""
    path = Path(cfg.path).expanduser()
    blocks = _Blocks(cfg.seed, cfg.block_size, _normal_token_ids(tokenizer))
    rng = _rng(cfg.seed, "prompts")  # lines without hash_ids
    out: list[WorkloadRequest] = []
    for lineno, obj in jsonl_objects(path):
        out.append(_parse_mooncake_line(obj, path, lineno, cfg, blocks, rng))
        if cfg.max_requests is not None and len(out) >= cfg.max_requests:
            break
    return out
