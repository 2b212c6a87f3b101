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
from typing import Any, Sequence

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


class Policy:
    """Base scheduling policy: first come, first served.

    Methods receive live ``Request`` objects; they must only read them (and keep their own state). Every method
    has a working default, so a subclass overrides only the decisions it changes.
    """

    registered_name: str = "custom"

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
