"""Scheduler mechanics: budgets, block allocation, preemption (by recompute, or by swap to a KV tier), and every
request state change.

Each step the running requests get their next tokens first (a decode, or the next prefill chunk), most urgent
first; when blocks run out the policy names a victim among those not yet scheduled, which loses its blocks and
goes back to waiting. Then, if nothing was preempted, waiting requests are admitted in the policy's order until
a budget or memory says stop. All decisions of *order* come from the ``Policy``; all *state* changes happen here:
status (waiting, running, preempted, finished, failed, aborted), ``finish_reason``, ``finish_time`` and ``error``
are written by this module alone (``update_from_output`` after a step, ``reject`` for a request the engine refuses,
``abort`` for one its caller gives up on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from nanovllm.allocator import BlockAllocator
from nanovllm.engine.kv_offload import PREEMPTION_MODES, KVOffload
from nanovllm.engine.waiting_queue import WaitingQueue, waiting_queue_for
from nanovllm.policy import Policy, PolicyError, SchedulerView, StepBudget
from nanovllm.request import Request, RequestStatus
from nanovllm.sampling import INVALID_TOKEN, NON_FINITE_REASON

__all__ = ["PolicyError", "Scheduler", "SchedulerOutput"]   # PolicyError lives with the seam; imported from here too

@dataclass
class SchedulerOutput:
    """One step's plan: each scheduled request with how many of its uncomputed tokens to compute now (a decode
    is 1; a prefill chunk or a recompute may be many), in batch order, and the requests preempted to make room."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)   # request, tokens to compute now
    preempted: list[Request] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0      # prompt tokens served from the prefix cache at this step's admissions
    num_recomputed_tokens: int = 0      # tokens computed again after a preemption (set by update_from_output)
    num_swapped_tokens: int = 0         # tokens of swapped-out requests loaded back at readmission (not computed)
    # Speculative decoding (set by update_from_output): requests whose proposals were verified, the proposals
    # verified and those accepted (vLLM's spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)   # [i]: accepted at proposal position i
    # Admitted requests whose prompt K/V came from a prefill replica, with the first block to load (the ones
    # before it were prefix-cache hits here): the engine loads them before the step runs.
    kv_loads: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Owns the waiting and running queues, the block allocator and every request state transition.

    The engine calls ``add``/``reject`` as requests come, ``schedule`` to plan a step, and
    ``update_from_output`` with the step's sampled tokens; the policy is consulted for every decision of order.
    """

    def __init__(
        self,
        policy: Policy,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        watermark: float = 0.01,
        offload: KVOffload | None = None,
        preemption_mode: str = "recompute",
    ) -> None:
        """``offload``: the KV tiers below the allocator's pool (None: none). ``preemption_mode``: ``recompute``
        (a victim's blocks are dropped) or ``swap`` (they go to the top tier and come back at readmission;
        needs ``offload``); a policy may choose per victim (``Policy.preemption_mode``)."""
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {preemption_mode!r}")
        self.policy = policy
        self.offload = offload
        self.preemption_mode = preemption_mode
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # Admission keeps a few blocks spare so newly admitted requests do not immediately force preemptions.
        self.watermark_blocks = int(watermark * allocator.num_blocks)
        # In the policy's order, kept at the cost its declarations allow (``waiting_queue.py``).
        self.waiting: WaitingQueue = waiting_queue_for(policy, self._ask)
        self.running: list[Request] = []
        self._rejected: list[Request] = []   # failed on arrival or aborted; reported by the next update_from_output
        self._handed_off: list[Request] = []  # prefilled for a decode replica, blocks held until the engine read them
        policy.bind_prefix_lookup(self.cached_prefix_len)

    def cached_prefix_len(self, request: Request) -> int:
        """How many of ``request``'s tokens are cached: in the allocator's pool, then (with KV tiers) in the
        tiers below, as a ``CachedPrefix`` (an int with ``by_tier``). A pure lookup (what ``lpm`` reads)."""
        cached = self.allocator.cached_prefix_len(request)
        return cached if self.offload is None else self.offload.cached_prefix_len(request, cached)

    # -- queue management ------------------------------------------------------------------------------------
    def add(self, request: Request, now: float) -> None:
        """``request`` arrived: it joins the waiting queue and the policy hears ``on_arrival``."""
        self.waiting.push(request)
        self._ask("on_arrival", request, now)

    def reject(self, request: Request, error: str, now: float) -> None:
        """End ``request`` as failed without running it (the engine refused it); it is reported as finished by
        the next ``update_from_output`` so every request leaves through the same door."""
        request.status = RequestStatus.FAILED
        request.error = error
        request.finish_time = now
        self._rejected.append(request)

    def abort(self, request_id: str, now: float, reason: str = "aborted") -> Request | None:
        """End the waiting or running request ``request_id`` now: status aborted, ``finish_reason`` "abort",
        ``error`` = ``reason``; its blocks go back to the allocator at once (a prefix cache keeps their content
        reusable) and the policy hears ``on_finish``. It is reported by the next ``update_from_output``, like a
        rejected request. Returns the request, or None when no unfinished request has that id (a no-op)."""
        request = next((r for r in self.running if r.request_id == request_id), None)
        if request is not None:
            self.running.remove(request)
        else:
            request = self.waiting.find(request_id)
            if request is None:
                return None
            self.waiting.remove(request)
        self.allocator.free(request)
        if self.offload is not None:
            self.offload.forget(request)
        request.status = RequestStatus.ABORTED
        request.finish_reason = "abort"
        request.error = reason
        request.finish_time = now
        self._rejected.append(request)
        self._ask("on_finish", request, now)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._rejected)

    def drain(self) -> tuple[list[Request], list[Request]]:
        """Empty this scheduler as its replica dies (a simulated cluster fault; the engine is not used again, so
        no block is freed and the policy hears nothing): returns (its unfinished requests, running then waiting;
        the requests that ended and were not reported yet: rejected or aborted)."""
        unfinished = [*self.running, *self.waiting]
        for request in list(self.waiting):
            self.waiting.remove(request)
        ended, self._rejected, self.running = self._rejected, [], []
        return unfinished, ended

    def update_from_output(self, out: SchedulerOutput, next_tokens: Sequence[int | None], now: float,
                           max_model_len: int, next_logprobs: Sequence[dict | None] | None = None) -> list[Request]:
        """The step ran: the scheduled tokens are in the cache and ``next_tokens`` (one per scheduled request,
        None for a partial prefill chunk) were sampled, with ``next_logprobs`` (per request, None unless it asked
        for logprobs). Advance every request, append its token, finish those that hit a stop condition (freeing
        their blocks) and tell the policy. Returns the requests that ended, rejected ones included."""
        finished, self._rejected = self._rejected, []
        proposed: list[int] = []   # per scheduled request, how many of its tokens were proposals to verify
        for request, num_new in out.scheduled:
            # Proposals are computed but not yet kept: only those verification accepts count (below).
            num_proposed = max(0, request.num_computed_tokens + num_new - request.num_tokens)
            num_new -= num_proposed
            proposed.append(num_proposed)
            # Tokens below the high-water mark were computed before a preemption threw them away.
            recomputed = max(0, min(request.num_computed_tokens + num_new, request.max_computed_tokens)
                             - request.num_computed_tokens)
            request.num_recomputed_tokens += recomputed
            out.num_recomputed_tokens += recomputed
            request.num_computed_tokens += num_new
            request.max_computed_tokens = max(request.max_computed_tokens, request.num_computed_tokens)
            self.allocator.on_tokens_computed(request)
            if self.offload is not None:
                self.offload.on_tokens_computed(request)
        self._ask("on_step", out.scheduled, now)
        logprobs = next_logprobs if next_logprobs is not None else [None] * len(next_tokens)
        for (request, _), num_proposed, token, token_logprobs in zip(out.scheduled, proposed, next_tokens, logprobs):
            if token is None:
                continue
            if isinstance(token, list):   # verified proposals: the accepted ones, then the target's own token
                self._append_verified(out, request, num_proposed, token, token_logprobs, now, max_model_len,
                                      finished)
                continue
            if token == INVALID_TOKEN:  # the sampler refused garbage logits: this request fails, others go on
                self._finish(request, None, now, RequestStatus.FAILED, NON_FINITE_REASON)
                finished.append(request)
                continue
            request.append_token(token, now, token_logprobs)
            reason = request.check_stop(max_model_len)
            if reason is not None:
                self._finish(request, reason, now)
                finished.append(request)
            elif request.hand_off_after_prefill and request.num_output_tokens == 1:
                self._hand_off(request, now)
        return finished

    def _append_verified(self, out: SchedulerOutput, request: Request, num_proposed: int, tokens: list[int],
                         logprobs: list[dict | None] | None, now: float, max_model_len: int,
                         finished: list[Request]) -> None:
        """Speculative decoding: append what verifying ``num_proposed`` proposals emitted (the accepted proposals,
        then one token of the target's own), stopping at the first stop condition, so a stop token, ``max_tokens``
        or the model's length inside an accepted run ends the request there. Each token after the first is an
        accepted proposal whose K/V this step wrote: it becomes computed as the next one is appended, so the
        newest token stays the only uncomputed one. The slots of rejected proposals hold stale K/V that the
        request's next tokens overwrite; blocks that held nothing else go back to the allocator."""
        accepted = len(tokens) - 1 - (tokens[-1] == INVALID_TOKEN)
        out.num_drafts += 1
        out.num_draft_tokens += num_proposed
        out.num_accepted_tokens += accepted
        per_pos = out.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_proposed - len(per_pos)))
        for position in range(accepted):   # accepted proposals are a prefix: positions 0 .. accepted - 1
            per_pos[position] += 1
        request.num_drafts += 1
        request.num_draft_tokens += num_proposed
        request.num_accepted_tokens += accepted
        request.num_rejected_drafts += accepted < num_proposed
        for j, token in enumerate(tokens):
            if token == INVALID_TOKEN:
                self._finish(request, None, now, RequestStatus.FAILED, NON_FINITE_REASON)
                finished.append(request)
                return
            if j > 0:
                request.num_computed_tokens += 1
            request.append_token(token, now, logprobs[j] if logprobs is not None else None)
            reason = request.check_stop(max_model_len)
            if reason is not None:
                self._finish(request, reason, now)
                finished.append(request)
                return
        request.max_computed_tokens = max(request.max_computed_tokens, request.num_computed_tokens)
        self.allocator.on_tokens_computed(request)
        self.allocator.free_tail(request, request.num_tokens)

    def _hand_off(self, request: Request, now: float) -> None:
        """Prefill/decode disaggregation: ``request`` (on a prefill replica) has its first token; it leaves this
        engine for a decode replica. Its blocks stay allocated until the engine has read its K/V
        (``take_handed_off``), then return to the allocator (a prefix cache keeps the prompt's)."""
        request.status = RequestStatus.HANDED_OFF
        self.running.remove(request)
        self._handed_off.append(request)
        self._ask("on_finish", request, now)

    def take_handed_off(self) -> list[Request]:
        """The requests handed off since the last call, blocks still held (the engine reads their K/V, then
        calls ``release``)."""
        handed, self._handed_off = self._handed_off, []
        return handed

    def release(self, request: Request) -> None:
        """Free a handed-off request's blocks once its K/V were read."""
        self.allocator.free(request)

    def _finish(self, request: Request, reason: str | None, now: float,
                status: RequestStatus = RequestStatus.FINISHED, error: str | None = None) -> None:
        request.status = status
        request.finish_reason = reason
        request.error = error
        request.finish_time = now
        self.allocator.free(request)
        if self.offload is not None:
            self.offload.forget(request)
        self.running.remove(request)
        self._ask("on_finish", request, now)

    # -- the step --------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        """Plan one step, in this order:

        0. ``reject_reason``: waiting requests the policy rejects end failed with its reason (asked as
           ``Policy.rejection`` says: of none, of those whose ``reject_after`` time has come, or of all).
        1. ``preempt_for``: while the most urgent waiting request cannot be admitted, the policy may name a
           running request to preempt in its favour.
        2. ``step_budget`` sets the step's token budget and mix. Decodes first (the default): running decodes,
           then running prefill chunks, each group most urgent first, get their next tokens within the budget;
           when blocks run out the policy's ``select_victim`` gives way. Prefill first: only running prefills
           and admissions run while any can; decodes run in steps without prefill work.
        3. Admission: waiting requests join in the policy's order while slots, tokens and blocks last --
           skipped entirely after a preemption for memory (admitting would only thrash the cache).
        """
        out = SchedulerOutput()
        self._reject_hopeless(now)
        self.waiting.order(now)
        if self.offload is not None:   # before admission: blocks of the queue's head move up to the top tier
            self.offload.prefetch(self.waiting)
        self._preempt_for_waiting(out, now)
        self._sort(self.running, now)
        plan = self._step_budget(out, now)
        if plan.decodes_first or not self._schedule_prefills_only(out, plan.max_tokens, now):
            self._schedule_decodes_first(out, plan.max_tokens, now)
        for request, _ in out.scheduled:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        return out

    def _schedule_decodes_first(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Decodes, then running prefill chunks, then admissions (each group in the policy's order)."""
        # A stable partition: the policy's order holds within decodes and within prefills.
        self.running.sort(key=lambda r: r.is_prefill)
        num_policy_preemptions = len(out.preempted)
        budget = self._schedule_running(out, budget, now)
        # After a preemption for memory, admitting new work would only thrash the cache (vLLM does the same).
        if len(out.preempted) == num_policy_preemptions:
            self._admit_waiting(out, budget, now)

    def _schedule_prefills_only(self, out: SchedulerOutput, budget: int, now: float) -> bool:
        """Prefill-first: running prefills, then admissions, no decodes. False if no prefill could run (the
        step then falls back to decodes first)."""
        num_policy_preemptions = len(out.preempted)
        budget = self._schedule_running(out, budget, now, only_prefills=True)
        if len(out.preempted) == num_policy_preemptions:
            self._admit_waiting(out, budget, now)
        return bool(out.scheduled)

    def _step_budget(self, out: SchedulerOutput, now: float) -> StepBudget:
        plan = self._ask("step_budget", self._view(out, self.max_num_batched_tokens), now)
        if not isinstance(plan, StepBudget) or not isinstance(plan.max_tokens, int) or plan.max_tokens < 1:
            raise PolicyError(f"policy {self.policy.registered_name!r}: step_budget must return a StepBudget "
                              f"with max_tokens >= 1, got {plan!r}")
        return StepBudget(min(plan.max_tokens, self.max_num_batched_tokens), plan.decodes_first)

    def _reject_hopeless(self, now: float) -> None:
        """Waiting requests the policy rejects end failed with its reason (freed, reported, told back). Which are
        asked, in queue order: none, those whose ``reject_after`` time has come, or all (``Policy.rejection``)."""
        if self.policy.rejection == "never":
            return
        timed = self.policy.rejection == "timed"
        for request in (self.waiting.due_for_rejection(now) if timed else list(self.waiting)):
            reason = self._ask("reject_reason", request, now)
            if reason is None:
                continue
            self.waiting.remove(request)
            self._undo_prefix_match(request)
            if self.offload is not None:
                self.offload.forget(request)
            self.reject(request, f"rejected by policy {self.policy.registered_name!r}: {reason}", now)
            self._ask("on_finish", request, now)

    def _schedule_running(self, out: SchedulerOutput, budget: int, now: float, only_prefills: bool = False) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if only_prefills and not request.is_prefill:
                index += 1
                continue
            num_new = min(request.num_uncomputed_tokens, budget)
            if request.spec_token_ids:
                num_new += self._fit_proposals(request, budget - num_new, len(self.running) - index - 1)
            if not self._make_room(request, num_new, self.running[index:], out, now):
                continue  # ``request`` itself was preempted; the list shrank under ``index``
            self.allocator.append(request, num_new)
            self.allocator.on_tokens_scheduled(request, num_new)
            out.scheduled.append((request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _fit_proposals(self, request: Request, budget: int, num_after: int) -> int:
        """Speculative decoding: how many of a decoding ``request``'s proposals ride along this step (the others
        are dropped). They take token budget and KV slots like any token, but never at the expense of another
        request: the budget left after one token for each of the ``num_after`` running requests still to
        schedule, and only blocks that are free now, less one for each of those (never a preemption)."""
        drafts = request.spec_token_ids
        k = max(0, min(len(drafts), budget - num_after)) if request.num_uncomputed_tokens == 1 else 0
        while k and not self.allocator.can_allocate(request, 1 + k, reserve=num_after):
            k -= 1
        del drafts[k:]
        return k

    def _make_room(self, request: Request, num_new: int, candidates: list[Request], out: SchedulerOutput,
                   now: float) -> bool:
        """Preempt policy-chosen victims until ``request`` can grow; False if ``request`` became the victim."""
        while not self.allocator.can_allocate(request, num_new):
            victim = self._ask("select_victim", list(candidates), now)
            if victim not in candidates:
                raise PolicyError(f"policy {self.policy.registered_name!r}: select_victim returned a request "
                                  "that is not among the candidates")
            self._preempt(victim, out, now)
            candidates.remove(victim)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.head()
            assert request is not None  # the queue is not empty
            allowed = self._ask("should_expand_batch", request, self._view(out, budget), now)
            if not allowed and self.running:  # a veto over an empty batch is ignored: the engine never stalls
                break
            # Set when its prompt's K/V came from a prefill replica: loaded, not computed.
            handoff = request.handoff if request.awaits_kv else None
            load = None
            if not request.block_table:
                cached = self.allocator.match_prefix(request)
                if handoff is None and self.offload is not None:   # the next blocks, from the tiers below
                    load = self.offload.plan(request, cached)
                    cached += self.offload.planned_tokens(load)
                request.num_computed_tokens = cached
                if handoff is None:   # a handed-off request keeps its prefill replica's count
                    request.num_cached_tokens = cached
            num_new = request.num_uncomputed_tokens
            if handoff is not None:  # blocks for every token; compute only those past the loaded K/V (the first output)
                num_new = request.num_tokens - handoff.num_tokens
            if num_new > budget and not self.enable_chunked_prefill:
                self._undo_prefix_match(request)
                break
            num_new = min(num_new, budget)
            to_allocate = request.num_uncomputed_tokens if handoff is not None else num_new
            # An empty batch always admits its head request (validation guarantees it fits the whole cache).
            reserve = self.watermark_blocks if self.running else 0
            if not self.allocator.can_allocate(request, to_allocate, reserve=reserve):
                self._undo_prefix_match(request)
                break
            self.allocator.allocate(request, to_allocate)
            if load is not None:
                self._load_from_tiers(request, load, out)
            if handoff is not None:
                out.kv_loads.append((request, request.num_computed_tokens // self.allocator.block_size))
                out.num_prefix_hit_tokens += request.num_computed_tokens
                request.num_computed_tokens = handoff.num_tokens
                handoff.loaded, handoff.decode_start_time = True, now
            else:
                out.num_prefix_hit_tokens += request.num_cached_tokens
            self.allocator.on_tokens_scheduled(request, num_new)
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new

    def _preempt_for_waiting(self, out: SchedulerOutput, now: float) -> None:
        """Let the policy swap the most urgent waiting request in for running ones when it cannot be admitted."""
        request = self.waiting.head()
        if request is None:
            return
        while self.running and self._blocked(request):
            victim = self._ask("preempt_for", request, list(self.running), now)
            if victim is None:
                return
            if victim not in self.running:
                raise PolicyError(f"policy {self.policy.registered_name!r}: preempt_for returned a request "
                                  "that is not running")
            self._preempt(victim, out, now)
            # The victim joined the waiting queue behind ``request``; keep the policy's order.
            self.waiting.order(now)

    def _blocked(self, request: Request) -> bool:
        """Could ``request`` not be admitted now for lack of a free slot or free blocks?"""
        needed = self.allocator.blocks_for(request.num_tokens) + self.watermark_blocks
        return len(self.running) >= self.max_num_seqs or needed > self.allocator.num_free_blocks()

    def _load_from_tiers(self, request: Request, load: Any, out: SchedulerOutput) -> None:
        """Admission with KV tiers: copy the planned blocks (swapped, or found below) into the request's fresh
        blocks. A block that fails to load is computed instead, with those after it (the step computes from
        there: its blocks are allocated already)."""
        assert self.offload is not None
        start = load.first_block * self.allocator.block_size
        loaded = self.offload.load(request, load)
        request.num_computed_tokens = start + loaded
        if load.swap:
            request.num_swapped_tokens += loaded
            out.num_swapped_tokens += loaded
            request.num_cached_tokens = start   # swapped tokens were this request's own, not a cache hit
            request.num_cached_tokens_by_tier = {"primary": start}
        else:
            request.num_cached_tokens = start + loaded
            request.num_cached_tokens_by_tier = {"primary": start, **loaded.by_tier}
        self.allocator.on_tokens_computed(request)   # loaded blocks join the pool's prefix cache

    def _preempt(self, request: Request, out: SchedulerOutput, now: float) -> None:
        """Preempt ``request`` back to waiting, its blocks freed: by recompute (computed tokens forgotten), or by
        swap (its computed blocks go to the top KV tier first; a full tier falls back to recompute)."""
        mode = self._ask("preemption_mode", request, now) or self.preemption_mode
        if mode not in PREEMPTION_MODES:
            raise PolicyError(f"policy {self.policy.registered_name!r}: preemption_mode must return None or one of "
                              f"{', '.join(PREEMPTION_MODES)}, got {mode!r}")
        if mode == "swap" and self.offload is not None and not request.awaits_kv:
            self.offload.swap_out(request)
        self.allocator.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.running.remove(request)
        self.waiting.push(request)
        out.preempted.append(request)

    def _undo_prefix_match(self, request: Request) -> None:
        if request.block_table:
            self.allocator.free(request)
        request.num_computed_tokens = 0
        if not request.awaits_kv:   # a handed-off request keeps its prefill replica's count
            request.num_cached_tokens = 0

    # -- helpers ---------------------------------------------------------------------------------------------
    def _sort(self, requests: list[Request], now: float) -> None:
        """Sort the running batch in the policy's order (it is small: at most ``max_num_seqs``)."""
        try:  # sort calls the key once per request
            requests.sort(key=lambda r: self._ask("priority", r, now))
        except TypeError as exc:
            raise PolicyError(f"policy {self.policy.registered_name!r}: priority keys are not comparable: {exc}")

    def _view(self, out: SchedulerOutput, budget: int) -> SchedulerView:
        return SchedulerView(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_scheduled_tokens=out.num_tokens, token_budget_left=budget, max_num_seqs=self.max_num_seqs,
            num_free_blocks=self.allocator.num_free_blocks(), num_total_blocks=self.allocator.num_blocks,
            block_size=self.allocator.block_size, max_num_batched_tokens=self.max_num_batched_tokens,
        )

    def _ask(self, method: str, *args: Any) -> Any:
        """Call a policy method; any exception becomes a PolicyError naming the policy and the method."""
        try:
            return getattr(self.policy, method)(*args)
        except PolicyError:
            raise
        except Exception as exc:
            raise PolicyError(
                f"policy {self.policy.registered_name!r} raised in {method}(): {type(exc).__name__}: {exc}"
            ) from exc
