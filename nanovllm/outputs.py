"""What the engine hands out: ``RequestOutput`` (what ``LLM.generate`` returns) and ``StepRecord`` (what one
``LLMEngine.step()`` did, the raw material of every serving metric and plot)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NotRequired, TypedDict


class StepRecord(TypedDict):
    """One engine step. ``start_time`` is the step's ``time.perf_counter()`` as the engine returns it; the
    harness makes it relative to its run's start when it writes ``steps.jsonl``."""

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
    prefix_hit_tokens: int              # prompt tokens served from the prefix cache at this step's admissions
    recomputed_tokens: int              # tokens computed again this step because a preemption dropped them
    num_evictions: int                  # cached blocks evicted during this step
    kv_slots_unused: int                # internal fragmentation: allocated slots of running requests not
                                        # holding a computed token, after the step
    # Speculative decoding (vLLM's names; 0 without it): requests whose proposals were verified this step, the
    # proposed tokens verified, and those the target accepted.
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    # [i]: proposals at position i (0 = first after the newest token) accepted this step, as long as the longest
    # proposal verified ([] without any); absent from the placeholder records of a Ray replica's failed step.
    spec_decode_num_accepted_tokens_per_pos: NotRequired[list[int]]
    # KV tiers (present only with kv_offload): tokens of swapped-out requests loaded back this step, and per
    # tier (by name) hit_tokens, blocks_written, blocks_loaded, bytes_written, bytes_loaded, failures this step,
    # and blocks / bytes held after it.
    swapped_tokens: NotRequired[int]
    kv_tiers: NotRequired[dict[str, dict[str, float]]]
    replica: NotRequired[int]           # on a cluster: the replica that ran the step


@dataclass
class RequestMetrics:
    """When things happened to one request (``time.perf_counter`` seconds)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    num_cached_tokens: int
    # Prefill/decode disaggregation (None on one engine or colocated replicas): the bytes of K/V moved from the
    # prefill replica to the decode replica and the seconds moving them took (read, transfer, write).
    kv_transfer_bytes: int | None = None
    kv_transfer_time: float | None = None
    # Speculative decoding (vLLM's names; 0 without it): steps that verified proposals of this request, the
    # proposed tokens verified, and those accepted (acceptance rate: accepted / draft tokens).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


@dataclass(frozen=True)
class Logprob:
    """One candidate token's log-probability under the model and its rank (1 = most likely), as in vLLM."""

    logprob: float
    rank: int


@dataclass
class RequestOutput:
    """One request's result, in the order of the prompts given to ``generate``. ``finish_reason`` is
    ``"stop"`` (EOS or a stop token, which ends ``token_ids``), ``"length"`` (``max_tokens`` or the model's
    context reached); ``metrics`` says when things happened to it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]             # generated ids; ends with the EOS id when generation stopped on it
    finish_reason: str | None        # "stop" or "length"
    metrics: RequestMetrics
    # With SamplingParams(logprobs=k): per generated token, {token id: Logprob} for the top k and the chosen one.
    logprobs: list[dict[int, Logprob]] | None = None
