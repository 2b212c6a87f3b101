"""Workloads: what requests arrive, when, and how long they are.

Four sources, chosen by the config's ``name``:

* ``synthetic`` -- arrivals from a gamma process (``request_rate``, ``burstiness``, as in ``vllm bench serve``),
  prompt and output lengths from a :class:`LengthDist`, optional shared-prefix groups, priority classes and
  clients. Prompts are token ids, so a request's prompt length is exact.
* ``chat`` -- real-looking chat prompts from the small dataset shipped in ``nanovllm/data/chat_prompts.json``,
  templated with the model's chat template; requests end at EOS.
* ``trace`` -- replay a JSONL trace (with arrival times), a Mooncake trace (arrivals in ms, prompts synthesised
  so that equal block hash ids are equal token blocks), a ShareGPT JSON file (arrivals synthesised) or a CSV
  trace of arrivals and token counts (Azure's LLM inference traces, Vidur's processed traces, BurstGPT).
* ``multi_turn`` -- conversations: each turn's prompt is the whole conversation so far, so it starts with the
  previous turn's prompt; turns carry their session's ``session_id`` (prefix caching, session-aware routing).

Every random choice comes from ``numpy.random.default_rng`` seeded by the config's ``seed`` -- one independent
stream per aspect (arrivals, lengths, prompts, ...), so changing e.g. the priority weights leaves the arrival
times and prompts of the same seed unchanged, and the global RNG state is never touched.

The config dataclasses double as Hydra structured configs (fields of simple types only). They validate
themselves when constructed; :func:`validate_workload_config` runs the same checks on an OmegaConf
``DictConfig`` with the same fields, and :func:`generate_workload` always calls it first.

One job per module: ``config`` (the dataclasses), ``validation``, ``distributions`` (arrivals, lengths),
``prompts``, ``traces`` (JSONL / ShareGPT parsing), ``mooncake`` (Mooncake traces), ``csv_traces`` (Azure,
Vidur, BurstGPT), ``conversations``
(multi-turn sessions), ``generate`` (the sources).
"""

from nanovllm.harness.workload.config import (
    ChatWorkloadConfig,
    LengthDist,
    MultiTurnWorkloadConfig,
    SyntheticWorkloadConfig,
    TraceWorkloadConfig,
    WorkloadRequest,
)
from nanovllm.harness.workload.csv_traces import CSV_FORMATS, read_csv_trace
from nanovllm.harness.workload.distributions import (
    LENGTH_KINDS,
    sample_arrival_times,
    sample_lengths,
)
from nanovllm.harness.workload.generate import generate_workload
from nanovllm.harness.workload.mooncake import read_mooncake_trace
from nanovllm.harness.workload.prompts import load_chat_prompts
from nanovllm.harness.workload.traces import read_jsonl_trace, read_sharegpt
from nanovllm.harness.workload.validation import (
    PROMPT_KINDS,
    TRACE_FORMATS,
    WORKLOAD_NAMES,
    validate_workload_config,
)

__all__ = [
    "ChatWorkloadConfig", "LengthDist", "MultiTurnWorkloadConfig", "SyntheticWorkloadConfig", "TraceWorkloadConfig",
    "WorkloadRequest", "sample_arrival_times", "sample_lengths", "generate_workload", "load_chat_prompts",
    "read_jsonl_trace", "read_mooncake_trace", "read_sharegpt", "read_csv_trace", "CSV_FORMATS", "LENGTH_KINDS", "PROMPT_KINDS", "TRACE_FORMATS",
    "WORKLOAD_NAMES", "validate_workload_config",
]
