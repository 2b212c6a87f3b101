"""The plain records a run produces: one per request (``requests.jsonl``) and one per engine step
(``steps.jsonl``). Metrics, loggers and plots read only these, never engine objects, so a run's files can be
analysed long after the engine is gone. All times are seconds since the run started (``perf_counter`` based).
"""

from __future__ import annotations

from typing import TypedDict


class RequestRecord(TypedDict):
    request_id: str
    client_id: str | None
    priority: int
    arrival_time: float                 # when the request entered the engine (its workload arrival time online)
    first_scheduled_time: float | None  # first step that ran any of its tokens
    first_token_time: float | None      # when its first output token was sampled
    finish_time: float | None           # when it finished (or failed)
    token_times: list[float]            # time of every output token, first token included
    num_prompt_tokens: int
    num_cached_tokens: int              # prompt tokens served from the prefix cache at (last) admission
    num_output_tokens: int
    num_preemptions: int
    finish_reason: str | None           # "stop", "length", or None when it failed
    error: str | None                   # why the engine rejected it; None when it ran


class StepRecord(TypedDict):
    step: int
    start_time: float
    duration: float                     # seconds spent in this step (schedule + forward + sample + update)
    num_prefill_tokens: int             # prompt tokens computed this step (chunks included)
    num_decode_tokens: int              # one per decoding request
    num_prefill_seqs: int
    num_decode_seqs: int
    num_running: int                    # requests holding KV blocks after the step
    num_waiting: int                    # requests waiting (preempted ones included) after the step
    num_preempted: int                  # preemptions made while scheduling this step
    kv_blocks_used: int
    kv_blocks_cached: int               # free blocks still holding reusable prefix-cache content
    kv_blocks_free: int
    kv_blocks_total: int
    context_tokens: int                 # sum over scheduled requests of their context length after the step
    attn_pairs: int                     # (query, key) pairs attended this step, causal mask respected
    num_sampled: int                    # sequences that produced logits (and a token) this step
