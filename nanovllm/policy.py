"""The scheduling seam. A ``Policy`` decides who goes first, who may join and who gives way; the scheduler
enforces budgets, allocates blocks and does the preemption itself, so a policy can never corrupt engine state.

A minimal policy overrides ``priority``::

    @register_policy("longest_prompt_first")
    class LongestPromptFirst(Policy):
        waiting_key = "static"   # optional: the key never changes while the request waits (a heap keeps order)

        def priority(self, request, now):
            return -request.num_prompt_tokens

What keeping the waiting queue in order costs follows from what the policy declares about its key
(``waiting_key``, ``priority_changes_at``) and its rejections (``reject_after``); a policy that declares nothing
gets the exact per-step re-sort and scan. The choices and their costs: docs/policy_library.md, "The waiting
queue's cost".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Sequence

from nanovllm.registry import Registry
from nanovllm.request import Request


# How ``Policy.priority`` of a waiting request behaves over time (``Policy.waiting_key``).
WaitingKey = Literal["static", "timed", "dynamic"]
WAITING_KEYS: tuple[str, ...] = ("static", "timed", "dynamic")
# How ``Policy.reject_reason`` is consulted (``Policy.rejection``, derived from what a class overrides).
Rejection = Literal["never", "timed", "every_step"]


class PolicyError(RuntimeError):
    """A policy method raised or returned something the scheduler cannot use."""


def a_hair_before(time: float, *operands: float) -> float:
    """``time`` moved a few units in the last place earlier, those of the largest of ``time`` and the ``operands``
    it was computed from: for ``priority_changes_at`` and ``reject_after``, which must never name a time later than
    the true one (the scheduler would miss the change) while an early one only costs a check that finds nothing yet.
    ``a_hair_before(arrival + max_wait, arrival, max_wait)`` is safe against the rounding of ``now - arrival``."""
    if not math.isfinite(time):
        return time
    scale = max([abs(time), 1.0, *(abs(x) for x in operands if math.isfinite(x))])
    return time - 8 * math.ulp(scale)


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

    # How ``priority`` of a *waiting* request behaves while it waits, which sets what keeping the waiting queue
    # in order costs the scheduler each step (n: requests waiting):
    #   "static":  fixed from the moment the request enters the waiting queue (it arrives, or comes back after a
    #              preemption) until it leaves it. The key is computed once, on entry; a heap keeps the order:
    #              O(log n) per entry and per admission, nothing per step.
    #   "timed":   as "static", except at the times ``priority_changes_at`` names (aging): a timer heap recomputes
    #              only the keys whose time has come. O(log n) per change.
    #   "dynamic": may change at any step (it reads counters, the prefix cache, ...): the whole queue is re-sorted
    #              every step, O(n log n) and n ``priority`` calls per step. Exact; what a subclass that overrides
    #              ``priority`` without declaring ``waiting_key`` gets (``__init_subclass__``), so no policy
    #              changes meaning silently. With ``waiting_window`` = W, an approximation with a bounded cost:
    #              only the W longest-waiting requests (arrival order) are ranked by ``priority`` each step, the
    #              others wait behind them in arrival order (SGLang's LPM falls back to FCFS past 128 waiting).
    # A "timed" key that is fixed between named times must be: ``tests/policies/test_waiting_queue.py`` checks
    # every built-in policy's declaration over a simulated run.
    waiting_key: WaitingKey = "static"
    waiting_window: int | None = None
    # Whether and how ``reject_reason`` is asked, derived from what a class overrides (``__init_subclass__``):
    # "never" (the default's reject_reason rejects nothing), "timed" (the class overrides ``reject_after``: only
    # requests whose time has come are asked, O(log n) each) or "every_step" (it overrides ``reject_reason``
    # alone: every waiting request is asked at every step, O(n) per step).
    rejection: ClassVar[Rejection] = "never"
    # Whether a simulated engine may take a run of pure-decode steps at once (``nanovllm.engine.decode_stretch``):
    # only when nothing the policy decides can change during it, i.e. it keeps no per-step state (``on_step``),
    # plans every step alike (``step_budget``) and orders the running batch by a key that never changes while a
    # request runs. Derived from what a class overrides (``__init_subclass__``); a class whose ``priority`` is
    # such a fixed key declares ``decode_stretches = True``.
    decode_stretches: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # An undeclared new priority may read anything: the exact full re-sort is the only safe assumption.
        if "priority" in cls.__dict__ and "waiting_key" not in cls.__dict__:
            cls.waiting_key = "dynamic"
        if "decode_stretches" not in cls.__dict__ and any(
                name in cls.__dict__ for name in ("priority", "on_step", "step_budget")):
            cls.decode_stretches = False
        if "reject_after" in cls.__dict__:
            cls.rejection = "timed"
        elif "reject_reason" in cls.__dict__:
            cls.rejection = "every_step"   # a new rule without its timing: ask every request, every step

    def priority(self, request: Request, now: float) -> Any:
        """A sortable key; smaller runs first. Orders the waiting queue for admission and the running batch for
        scheduling (the least urgent running requests are the first preemption candidates). The scheduler asks
        it of a waiting request when the request enters the waiting queue and then as ``waiting_key`` says (every
        step for "dynamic"), and of every running request at every step. Equal keys keep the order they had
        (entry order into the waiting queue for keys that never changed), as a stable sort would."""
        return (request.arrival_time,)

    def priority_changes_at(self, request: Request, now: float) -> float | None:
        """For ``waiting_key = "timed"``: the earliest time at which ``priority(request, t)`` of this waiting
        request may differ from ``priority(request, now)``; None if it never will while the request waits. The
        scheduler asks it right after computing the key at ``now`` (on entry, and each time the named time has
        come), and recomputes the key at the first step whose time is at or past the answer. A time that is early
        only costs a recomputation; a late one breaks the order (``a_hair_before`` guards against rounding)."""
        return None

    def should_expand_batch(self, request: Request, view: SchedulerView, now: float) -> bool:
        """May ``request`` (the next waiting one in priority order) join the batch this step? Returning False
        stops admission for this step. Budgets and memory are checked by the scheduler after this."""
        return True

    def select_victim(self, candidates: Sequence[Request], now: float) -> Request:
        """Memory ran out: which of ``candidates`` (running requests not yet scheduled this step) to preempt.
        Default: the least urgent by ``priority``, latest arrival breaking ties."""
        return max(candidates, key=lambda r: (self.priority(r, now), r.arrival_time))

    def preemption_mode(self, victim: Request, now: float) -> str | None:
        """``victim`` is being preempted (asked right after ``select_victim`` or ``preempt_for`` named it):
        ``"recompute"`` (drop its blocks), ``"swap"`` (send them to the top KV tier, loaded back when it is
        readmitted; needs ``kv_offload``), or None for the engine's ``preemption_mode`` (the default)."""
        return None

    def preempt_for(self, waiting: Request, running: Sequence[Request], now: float) -> Request | None:
        """``waiting`` cannot be admitted (no free slot or blocks). Return a running request to preempt in its
        favour, or None (the default: never preempt for a waiting request)."""
        return None

    def step_budget(self, view: SchedulerView, now: float) -> StepBudget:
        """The token budget and prefill/decode mix of the step about to be built. Default: the engine's
        ``max_num_batched_tokens``, decodes first."""
        return StepBudget(view.max_num_batched_tokens)

    def reject_reason(self, request: Request, now: float) -> str | None:
        """Asked of waiting requests at the start of each step: a reason string ends ``request`` as failed with
        that reason (counted as failed in the metrics, e.g. a deadline that can no longer be met); None (the
        default) keeps it waiting. Which requests are asked depends on ``rejection``: a class that overrides only
        this is asked of every waiting request at every step (O(n) per step); one that also overrides
        ``reject_after`` only of those whose time has come."""
        return None

    def reject_after(self, request: Request, now: float) -> float | None:
        """The earliest time at which ``reject_reason`` may reject this waiting request (None: never), so the
        scheduler asks ``reject_reason`` only from then on instead of at every step. Asked at the first step after
        the request enters the waiting queue, and again after a step at which its time had come but
        ``reject_reason`` kept it. Overriding it declares ``rejection = "timed"``; an early time only costs a
        check, a late one misses a rejection (``a_hair_before`` guards against rounding)."""
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


def resorted_every_step(policy_class: type[Policy]) -> type[Policy]:
    """``policy_class`` as the scheduler ran every policy before the waiting queue kept its order incrementally:
    the whole waiting queue re-sorted at every step (``waiting_key = "dynamic"``, no window) and every waiting
    request asked ``reject_reason`` at every step. The same decisions at the old cost: the reference that the
    incremental paths are tested against (tests/policies/test_waiting_keys.py) and the "before" of
    experiments/bench_scheduler.py."""
    return type(f"{policy_class.__name__}ResortedEveryStep", (policy_class,), {
        "__doc__": resorted_every_step.__doc__, "__module__": policy_class.__module__,
        "waiting_key": "dynamic", "rejection": "every_step",
        # No window, whatever the constructor was given (lpm and fair take one).
        "waiting_window": property(lambda self: None, lambda self, value: None),
    })


POLICIES: Registry[Policy] = Registry("policy", base=Policy, builtin_packages=("policies",))


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator registering a ``Policy`` subclass under ``name`` (``scheduler.name=<name>``)."""
    return POLICIES.register(name)
