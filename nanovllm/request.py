"""A request's life in the engine: its tokens, its status, and when things happened to it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from nanovllm.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # never run yet
    RUNNING = "running"      # holds KV blocks, scheduled every step
    PREEMPTED = "preempted"  # lost its blocks; waits to be recomputed
    FINISHED = "finished"
    FAILED = "failed"        # refused by the engine (``LLMEngine.add_request(request, error=...)``); ``error`` says why
    ABORTED = "aborted"      # ended early by ``LLMEngine.abort_request`` (finish_reason "abort"); ``error`` says why


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

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

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
