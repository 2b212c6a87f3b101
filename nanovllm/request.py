"""A request's life in the engine: its tokens, its status, and when things happened to it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from nanovllm.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # never run yet
    RUNNING = "running"      # holds KV blocks, scheduled every step
    PREEMPTED = "preempted"  # lost its blocks; waits to be recomputed
    FINISHED = "finished"
    FAILED = "failed"        # refused by the engine (``LLMEngine.add_request(request, error=...)``); ``error`` says why
    ABORTED = "aborted"      # ended early by ``LLMEngine.abort_request`` (finish_reason "abort"); ``error`` says why
    HANDED_OFF = "handed_off"  # prefilled on a prefill replica, its K/V on the way to a decode replica (not ended)


@dataclass(eq=False)
class KVHandoff:
    """Prefill/decode disaggregation (``nanovllm.cluster.disaggregated``): one request's move from the prefill
    replica that computed its prompt (and sampled its first token) to the decode replica that generates the rest.

    The prefill engine fills ``data`` (the prompt's blocks, as ``Runner.read_kv`` returns them; None when
    simulated) and ``num_bytes``; the cluster moves it (``KVTransfer``) and stamps the times; the decode engine's
    scheduler loads it into the blocks it allocates at admission, like any allocation, and drops ``data``."""

    prefill_replica: int
    num_tokens: int                       # tokens whose K/V moved: the prompt
    num_bytes: int                        # bytes moved (whole blocks)
    data: Any = None                      # the K/V on their way; None once loaded (or when simulated)
    prefill_end_time: float | None = None   # when the prefill replica handed the request off
    transfer_time: float = 0.0            # seconds spent moving the bytes (measured, or modelled when simulated)
    arrival_time: float | None = None     # when it joined the decode replica's waiting queue
    decode_start_time: float | None = None  # its first step on the decode replica
    loaded: bool = False                  # the decode replica's cache holds it (set at admission)
    # The transfer failed (or its decode replica died before loading it): nothing to load, the decode replica
    # computes the prompt itself.
    failed: bool = False
    sampler_state: Any = None             # a seeded request's generator state, between processes


@dataclass(eq=False)
class Request:
    """One generation request. Policies may read every field; only the scheduler and engine write them.

    ``token_ids`` holds the prompt followed by the output so far; ``num_computed_tokens`` counts the tokens whose
    K/V are in the cache (prefix-cache hits included), so the next step computes ``token_ids[num_computed:]``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    client_id: str | None = None
    prompt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    slo_ttft: float | None = None     # seconds from arrival to the first token this request should meet (edf)
    slo_e2el: float | None = None     # seconds from arrival to the last token this request should meet (edf)
    session_id: str | None = None     # the conversation it belongs to (a router may keep a session on one replica)

    token_ids: list[int] = field(init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    block_table: list[int] = field(default_factory=list, init=False)
    num_cached_tokens: int = field(default=0, init=False)
    num_preemptions: int = field(default=0, init=False)
    num_recomputed_tokens: int = field(default=0, init=False)  # tokens computed again after a preemption
    # With KV tiers: num_cached_tokens at (last) admission split by where they came from (``primary``, then
    # each tier by name); None without tiers.
    num_cached_tokens_by_tier: dict[str, int] | None = field(default=None, init=False)
    num_swapped_tokens: int = field(default=0, init=False)  # tokens loaded back after a preemption by swap
    max_computed_tokens: int = field(default=0, init=False)    # high-water mark of num_computed_tokens
    first_scheduled_time: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    finish_time: float | None = field(default=None, init=False)
    token_times: list[float] = field(default_factory=list, init=False)
    finish_reason: str | None = field(default=None, init=False)
    error: str | None = field(default=None, init=False)
    replica: int | None = field(default=None, init=False)   # the cluster replica a router sent it to
    generator: torch.Generator | None = field(default=None, init=False, repr=False)
    logprobs: list[dict] | None = field(default=None, init=False, repr=False)  # one per output token if asked
    # Prefill/decode disaggregation: end on this (prefill) engine once the first token is sampled, handing the
    # request off with its K/V (``KVHandoff``); set by the cluster on the way in.
    hand_off_after_prefill: bool = field(default=False, init=False)
    handoff: KVHandoff | None = field(default=None, init=False, repr=False)
    # Speculative decoding (``nanovllm.proposer``): the tokens proposed to follow ``token_ids`` this step (set by
    # the engine before scheduling; the scheduler may drop some for lack of budget or blocks), and what
    # verification did with this request's proposals so far (vLLM's spec_decode counters).
    spec_token_ids: list[int] = field(default_factory=list, init=False, repr=False)
    num_drafts: int = field(default=0, init=False)            # steps that verified proposals of this request
    num_draft_tokens: int = field(default=0, init=False)      # tokens proposed and verified
    num_accepted_tokens: int = field(default=0, init=False)   # of those, the ones the target agreed with
    num_rejected_drafts: int = field(default=0, init=False)   # verifications that ended on a rejected one
    # What the proposer itself did for this request, before the scheduler dropped anything: the steps it was asked
    # for tokens, the steps it had some, and how many (the simulator's acceptance model reads these: how often and
    # how much a proposer proposes is its own; how much of that rides along depends on the load).
    num_proposer_asks: int = field(default=0, init=False)
    num_proposals: int = field(default=0, init=False)
    num_proposal_tokens: int = field(default=0, init=False)
    # Cluster faults (``RayCluster``; a simulated cluster's ``cluster.faults``): the replicas this request was on
    # when they died, in order (it resumed on another each time, its prompt and generated tokens recomputed
    # there), and how many tokens those replicas had computed that were computed again.
    retried_from: list[int] = field(default_factory=list, init=False)
    retry_recomputed_tokens: int = field(default=0, init=False)

    @property
    def awaits_kv(self) -> bool:
        """True while a handed-off request's K/V wait to be loaded on its decode replica (at admission)."""
        return self.handoff is not None and not self.handoff.loaded and not self.handoff.failed

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_retries(self) -> int:
        """How many times a dead replica's request resumed on another one (``retried_from``)."""
        return len(self.retried_from)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the newest token is still to be computed (a prompt, or a recompute)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.ABORTED)

    def append_token(self, token_id: int, now: float, logprobs: dict | None = None) -> None:
        self.token_ids.append(token_id)
        self.token_times.append(now)
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprobs)
        if self.first_token_time is None:
            self.first_token_time = now

    def check_stop(self, max_model_len: int) -> str | None:
        """The finish reason once the newest token ends the request, else None."""
        last = self.token_ids[-1]
        params = self.sampling_params
        if not params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if params.stop_token_ids and last in params.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
