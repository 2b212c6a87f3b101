"""The scheduling seam. A ``Policy`` decides who goes first, who may join and who gives way; the scheduler
enforces budgets, allocates blocks and does the preemption itself, so a policy can never corrupt engine state.

A minimal policy overrides ``priority``::

    @register_policy("longest_prompt_first")
    class LongestPromptFirst(Policy):
        def priority(self, request, now):
            return -request.num_prompt_tokens
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from nanovllm.registry import Registry
from nanovllm.request import Request


@dataclass(frozen=True)
class SchedulerView:
    """A read-only snapshot of the scheduler that policies may consult."""

    num_running: int
    num_waiting: int
    num_scheduled_tokens: int     # tokens already given out in the step being built
    token_budget_left: int
    max_num_seqs: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    max_num_batched_tokens: int = 2048   # the engine's hard cap on tokens per step


@dataclass(frozen=True)
class StepBudget:
    """What a policy asks of the step being built (``Policy.step_budget``).

    ``max_tokens``: tokens the step may compute (the scheduler caps it at ``max_num_batched_tokens``).
    ``decodes_first`` True (default, stall-free as in Sarathi-Serve): running decodes get their token first,
    then running prefill chunks, then new prefills chunked into what is left. False (prefill-first, as in
    vLLM's original scheduler and Orca): whenever prefill work can run, the step runs prefills only, whole
    where the budget allows, and decodes wait for a step without prefills.
    """

    max_tokens: int
    decodes_first: bool = True


class Policy:
    """Base scheduling policy: first come, first served.

    Methods receive live ``Request`` objects; they must only read them (and keep their own state). Every method
    has a working default, so a subclass overrides only the decisions it changes.
    """

    registered_name: str = "custom"
    _prefix_lookup: Callable[[Request], int] | None = None

    def priority(self, request: Request, now: float) -> Any:
        """A sortable key; smaller runs first. Orders the waiting queue for admission and the running batch for
        scheduling (the least urgent running requests are the first preemption candidates)."""
        return (request.arrival_time,)

    def should_expand_batch(self, request: Request, view: SchedulerView, now: float) -> bool:
        """May ``request`` (the next waiting one in priority order) join the batch this step? Returning False
        stops admission for this step. Budgets and memory are checked by the scheduler after this."""
        return True

    def select_victim(self, candidates: Sequence[Request], now: float) -> Request:
        """Memory ran out: which of ``candidates`` (running requests not yet scheduled this step) to preempt.
        Default: the least urgent by ``priority``, latest arrival breaking ties."""
        return max(candidates, key=lambda r: (self.priority(r, now), r.arrival_time))

    def preempt_for(self, waiting: Request, running: Sequence[Request], now: float) -> Request | None:
        """``waiting`` cannot be admitted (no free slot or blocks). Return a running request to preempt in its
        favour, or None (the default: never preempt for a waiting request)."""
        return None

    def step_budget(self, view: SchedulerView, now: float) -> StepBudget:
        """The token budget and prefill/decode mix of the step about to be built. Default: the engine's
        ``max_num_batched_tokens``, decodes first."""
        return StepBudget(view.max_num_batched_tokens)

    def reject_reason(self, request: Request, now: float) -> str | None:
        """Asked of every waiting request at the start of each step: a reason string ends ``request`` as
        failed with that reason (counted as failed in the metrics, e.g. a deadline that can no longer be met);
        None (the default) keeps it waiting."""
        return None

    def cached_prefix_len(self, request: Request) -> int:
        """How many of ``request``'s tokens the allocator's prefix cache holds now, without touching the cache
        (no reference taken, no recency or hit count changed). 0 when the allocator caches nothing or before
        the scheduler has bound the policy to its allocator."""
        return self._prefix_lookup(request) if self._prefix_lookup is not None else 0

    def bind_prefix_lookup(self, lookup: Callable[[Request], int]) -> None:
        """Called by the scheduler with its allocator's side-effect-free ``cached_prefix_len``."""
        self._prefix_lookup = lookup

    # Callbacks for stateful rules (VTC counters, MLFQ demotion). They must not mutate requests.
    def on_arrival(self, request: Request, now: float) -> None:
        """A request entered the waiting queue."""

    def on_step(self, scheduled: Sequence[tuple[Request, int]], now: float) -> None:
        """A step ran: each scheduled request with the number of tokens it computed."""

    def on_finish(self, request: Request, now: float) -> None:
        """A request finished (or failed)."""


POLICIES: Registry[Policy] = Registry("policy", base=Policy, builtin_packages=("policies",))


def register_policy(name: str):
    """Class decorator registering a ``Policy`` subclass under ``name`` (``scheduler.name=<name>``)."""
    return POLICIES.register(name)
