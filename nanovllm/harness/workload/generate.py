"""Build a workload's requests from its config: the ``synthetic``, ``chat``, ``trace`` and ``multi_turn`` sources."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import numpy as np

from nanovllm.chat_template import chat_token_ids
from nanovllm.harness.workload.config import WorkloadRequest
from nanovllm.harness.workload.conversations import multi_turn_requests
from nanovllm.harness.workload.csv_traces import CSV_FORMATS, detect_csv_format, read_csv_trace
from nanovllm.harness.workload.distributions import (
    _rng,
    _sample_clients,
    _sample_priorities,
    _slo_targets,
    sample_arrival_times,
    sample_lengths,
)
from nanovllm.harness.workload.prompts import _synthetic_prompts, load_chat_prompts
from nanovllm.harness.workload.mooncake import looks_like_mooncake, read_mooncake_trace
from nanovllm.harness.workload.traces import jsonl_objects, read_jsonl_trace, read_sharegpt
from nanovllm.harness.workload.validation import validate_workload_config


def _synthetic_workload(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    n = cfg.num_requests
    arrivals = sample_arrival_times(n, cfg.request_rate, cfg.burstiness, _rng(cfg.seed, "arrivals"))
    input_lens = sample_lengths(cfg.input_len, n, _rng(cfg.seed, "input_len"))
    output_lens = sample_lengths(cfg.output_len, n, _rng(cfg.seed, "output_len"))
    prompts = _synthetic_prompts(cfg, tokenizer, input_lens)
    priorities = _sample_priorities(cfg, n, _rng(cfg.seed, "priority"))
    clients = _sample_clients(cfg, n, _rng(cfg.seed, "client"))
    return [
        WorkloadRequest(arrival_time=float(arrivals[i]), prompt=prompts[i], max_tokens=int(output_lens[i]),
                        priority=priorities[i], client_id=clients[i], ignore_eos=bool(cfg.ignore_eos),
                        **_slo_targets(cfg, priorities[i]))
        for i in range(n)
    ]


def _chat_workload(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    n = cfg.num_requests
    convs = load_chat_prompts()
    pick = _rng(cfg.seed, "chat_pick")
    # Whole shuffled passes over the dataset: every conversation is used once before any repeats.
    order = np.concatenate([pick.permutation(len(convs)) for _ in range(-(-n // len(convs)))])[:n]
    arrivals = sample_arrival_times(n, cfg.request_rate, cfg.burstiness, _rng(cfg.seed, "arrivals"))
    priorities = _sample_priorities(cfg, n, _rng(cfg.seed, "priority"))
    clients = _sample_clients(cfg, n, _rng(cfg.seed, "client"))
    return [
        WorkloadRequest(arrival_time=float(arrivals[i]), prompt=chat_token_ids(tokenizer, convs[j]),
                        max_tokens=int(cfg.max_tokens), priority=priorities[i], client_id=clients[i],
                        ignore_eos=False, messages=convs[j], **_slo_targets(cfg, priorities[i]))
        for i, j in enumerate(order)
    ]


_TRACE_READERS: dict[str, Callable[[Any, Any], list[WorkloadRequest]]] = {
    "jsonl": read_jsonl_trace, "mooncake": read_mooncake_trace, "sharegpt": read_sharegpt,
    **{name: functools.partial(read_csv_trace, trace_format=name) for name in CSV_FORMATS},
}


def _trace_format(cfg: Any) -> str:
    """The trace's format: the configured one, else by the file's name (``.json``: ShareGPT) and, for a
    ``.jsonl``, by its first line's fields (Mooncake's or nano-vllm's), for a ``.csv`` by its header's columns
    (Azure's, Vidur's or BurstGPT's)."""
    if cfg.format != "auto":
        return cfg.format
    path = Path(cfg.path).expanduser()
    if path.suffix == ".json":
        return "sharegpt"
    if path.suffix == ".csv":
        return detect_csv_format(path)
    first = next(jsonl_objects(path), None)
    return "mooncake" if first is not None and looks_like_mooncake(first[1]) else "jsonl"


def _trace_workload(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    requests = _TRACE_READERS[_trace_format(cfg)](cfg, tokenizer)
    if not requests:  # an empty run would "succeed" with no numbers: almost surely the wrong file
        raise ValueError(f"{cfg.path}: the trace holds no usable requests")
    return requests


_GENERATORS: dict[str, Callable[[Any, Any], list[WorkloadRequest]]] = {
    "synthetic": _synthetic_workload, "chat": _chat_workload, "trace": _trace_workload,
    "multi_turn": multi_turn_requests,
}


def generate_workload(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    """Validate ``cfg`` and build its requests, sorted by arrival time (ties keep generation order).

    Requests without an id get their index in that order (``"0"``, ``"1"``, ...).
    """
    validate_workload_config(cfg)
    requests = sorted(_GENERATORS[cfg.name](cfg, tokenizer), key=lambda r: r.arrival_time)
    for i, req in enumerate(requests):
        if req.request_id is None:
            req.request_id = str(i)
    return requests
