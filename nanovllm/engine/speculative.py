"""Speculative decoding in the engine: asking the proposer before each step, and verifying its proposals after
the target's forward pass.

One step of a request with proposals ``d_1..d_k``: the scheduler schedules its newest token plus the k
proposals (they count against the token budget and get KV slots like any token); the runner feeds all k+1
through one target forward over the paged cache, as a small prefill chunk, and takes logits at each of the k+1
positions; ``verify_proposals`` keeps the longest prefix of proposals the target agrees with and adds one token
of the target's own (a correction, or a bonus when all were accepted); the scheduler appends those and counts
as computed only the K/V of tokens that were kept, so the slots of rejected proposals are overwritten later.
"""

from __future__ import annotations

from typing import Sequence

import torch

from nanovllm.config import EngineConfig
from nanovllm.outputs import Logprob, StepRecord
from nanovllm.proposer import PROPOSERS, Proposer, ProposerContext, ProposerError, proposer_spec
from nanovllm.request import Request
from nanovllm.sampling import INVALID_TOKEN, Sampler, SamplingParams, greedy_tokens, top_logprobs
from nanovllm.spec_policy import SPEC_POLICIES, SpeculationPolicy, SpeculationState, StepCost, spec_policy_spec


class StepCostFit:
    """The engine's measured decode-step cost for speculation policies: a least-squares line of step seconds
    against tokens computed, over decode-only steps, each older step weighing ``decay`` times less (so the fit
    follows the machine's current load). None until ``min_steps`` steps were seen at two or more sizes."""

    def __init__(self, decay: float = 0.95, min_steps: int = 4) -> None:
        self.decay, self.min_steps = decay, min_steps
        self.num_steps = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One decode-only step that computed ``num_tokens`` tokens in ``seconds``."""
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + num_tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + num_tokens * num_tokens
        self._xy = d * self._xy + num_tokens * seconds
        self.num_steps += 1

    def estimate(self) -> StepCost | None:
        if self.num_steps < self.min_steps:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < 1e-3:   # every step computed as many tokens: no slope to read
            return None
        # Noise can tilt the line below zero; a verified token never makes a step faster.
        per_token = max(0.0, (self._xy / self._w - mean_x * mean_y) / var_x)
        fixed = mean_y - per_token * mean_x
        if fixed <= 0.0:   # a line through the origin or below: read the whole step as per-token cost
            return StepCost(0.0, mean_y / mean_x) if mean_x > 0 else None
        return StepCost(fixed, per_token)


class Speculator:
    """The engine's side of speculation: the proposer of ``EngineConfig.speculative``, its speculation policy
    (how many tokens each request may get this step, at most ``num_speculative_tokens``, capped again so that
    no accepted run can pass the request's ``max_tokens`` or the model's length) and the measured step cost
    the policy may read."""

    def __init__(self, config: EngineConfig, context: ProposerContext) -> None:
        assert config.speculative is not None
        self.num_tokens: int = config.speculative["num_speculative_tokens"]
        # A runner that simulates the model (runner=sim) proposes stand-in tokens instead (Runner.stand_in_proposer).
        make_stand_in = getattr(context.runner, "stand_in_proposer", None)
        stand_in = make_stand_in(context) if make_stand_in is not None else None
        self.proposer: Proposer = stand_in if stand_in is not None else PROPOSERS.build(
            proposer_spec(config.speculative), context)
        self.policy: SpeculationPolicy = SPEC_POLICIES.build(spec_policy_spec(config.speculative))
        self.vocab_size = context.vocab_size
        self.step_cost = StepCostFit()
        self.step_fed_tokens = 0   # what the proposer's model was fed in this step's ``propose``

    @property
    def counts_fed_tokens(self) -> bool:
        """Whether the proposer runs a model whose fed tokens the step records carry."""
        return self.proposer.feeds_a_model

    def propose(self, running: Sequence[Request], max_model_len: int) -> None:
        """Before the scheduler plans a step: set ``spec_token_ids`` of every running request (empty for those
        that do not decode this step, may not get more tokens, or that the policy gives none)."""
        self.step_fed_tokens = 0
        candidates: list[tuple[Request, int]] = []
        num_decoding = 0
        for request in running:
            request.spec_token_ids = []
            if _decodes(request):
                num_decoding += 1
                limit = self._limit(request, max_model_len)
                if limit > 0:
                    candidates.append((request, limit))
        if not candidates:
            return
        state = SpeculationState(num_running=len(running), num_decoding=num_decoding,
                                 max_num_tokens=self.num_tokens, step_cost=self.step_cost.estimate())
        requests: list[Request] = []
        limits: list[int] = []
        for request, limit in candidates:
            k = min(limit, self._ask_policy(request, state))
            if k > 0:
                requests.append(request)
                limits.append(k)
        if not requests:
            return
        name = self.proposer.registered_name
        fed_before = self.proposer.num_fed_tokens
        try:
            proposals = self.proposer.propose(requests, limits)
        except Exception as exc:
            raise ProposerError(f"proposer {name!r} raised in propose(): {type(exc).__name__}: {exc}") from exc
        self.step_fed_tokens = self.proposer.num_fed_tokens - fed_before
        if len(proposals) != len(requests):
            raise ProposerError(f"proposer {name!r}: propose() returned {len(proposals)} proposals for "
                                f"{len(requests)} requests")
        for request, limit, tokens in zip(requests, limits, proposals):
            tokens = list(tokens)
            if len(tokens) > limit:
                raise ProposerError(f"proposer {name!r}: {len(tokens)} tokens proposed for request "
                                    f"{request.request_id}, at most {limit} allowed")
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in tokens):
                raise ProposerError(f"proposer {name!r}: proposed ids must be integers in [0, {self.vocab_size}), "
                                    f"got {tokens!r}")
            request.spec_token_ids = tokens
            request.num_proposer_asks += 1
            request.num_proposals += bool(tokens)
            request.num_proposal_tokens += len(tokens)

    def _ask_policy(self, request: Request, state: SpeculationState) -> int:
        name = self.policy.registered_name
        try:
            k = self.policy.num_speculative_tokens(request, state)
        except Exception as exc:
            raise ProposerError(f"speculation policy {name!r} raised in num_speculative_tokens(): "
                                f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= state.max_num_tokens:
            raise ProposerError(f"speculation policy {name!r}: num_speculative_tokens() must return an integer in "
                                f"[0, {state.max_num_tokens}], got {k!r} for request {request.request_id}")
        return k

    def _limit(self, request: Request, max_model_len: int) -> int:
        """How many tokens a decoding ``request`` may have proposed now: at most as many as could still be
        emitted after the target's own token, so that verification never writes K/V past ``max_tokens`` or the
        model's length."""
        left = min(request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens)
        return max(0, min(self.num_tokens, left - 1))

    def observe_step(self, record: StepRecord) -> None:
        """After each step: a decode-only step's duration and tokens feed the step-cost fit."""
        if record["num_prefill_tokens"] == 0 and record["num_decode_seqs"] > 0:
            self.step_cost.observe(record["num_decode_tokens"], record["duration"])

    def on_finish(self, requests: Sequence[Request]) -> None:
        """Requests ended this step: the proposer and the policy forget them."""
        for request in requests:
            request.spec_token_ids = []
            self.proposer.on_finish(request)
            self.policy.on_finish(request)


def _decodes(request: Request) -> bool:
    """Whether ``request`` decodes this step (only its newest token is not in the cache, and it has output
    already) and stays here to do so (a request prefilled for another replica leaves after its first token)."""
    return request.num_uncomputed_tokens == 1 and request.num_output_tokens > 0 and not request.hand_off_after_prefill


def num_proposed(request: Request, num_new: int) -> int:
    """How many of the ``num_new`` tokens scheduled for ``request`` are proposals (those past its newest token)."""
    return max(0, request.num_computed_tokens + num_new - request.num_tokens)


def verify_proposals(logits: torch.Tensor, proposals: Sequence[int], params: SamplingParams,
                     generator: torch.Generator) -> list[int]:
    """The tokens one verification emits. ``logits`` [k+1, vocab]: row j is the target's next-token logits after
    the request's tokens and the first j proposals. Returns the accepted proposals followed by one token of the
    target's own (1 to k+1 tokens), ending with ``INVALID_TOKEN`` if a row needed holds NaN or +inf.

    Greedy: a proposal is accepted while it equals the target's argmax, and the argmax after the last accepted
    one is emitted: exactly the tokens decoding one at a time would produce. Sampling: rejection sampling for a
    proposal distribution that is a point mass (the proposal itself): accept ``d`` with probability ``p(d)``
    under the target's processed distribution (temperature, top-k, top-p), else draw from ``p`` with ``d``
    removed, renormalised; after k acceptances draw the bonus from the last row. Each emitted token is then
    distributed exactly as the target's ``p``."""
    k = len(proposals)
    assert logits.shape[0] == k + 1
    if params.greedy:
        targets, bad = greedy_tokens(logits)
        targets_list, bad_list = targets.tolist(), bad.tolist()
        out: list[int] = []
        for j in range(k + 1):
            if bad_list[j]:
                return out + [INVALID_TOKEN]
            out.append(targets_list[j])
            if j == k or targets_list[j] != proposals[j]:
                return out
        return out
    bad_rows = (logits.isnan() | (logits == float("inf"))).any(dim=-1).tolist()
    probs = Sampler._probabilities(logits.float(), [params] * (k + 1))
    out = []
    for j, token in enumerate(proposals):
        if bad_rows[j]:
            return out + [INVALID_TOKEN]
        p = probs[j]
        if torch.rand((), generator=generator, device=p.device) < p[token]:
            out.append(token)
            continue
        residual = p.clone()
        residual[token] = 0.0
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)[0]))
        return out
    if bad_rows[k]:
        return out + [INVALID_TOKEN]
    out.append(int(torch.multinomial(probs[k], 1, generator=generator)[0]))
    return out


def emitted_logprobs(logits: torch.Tensor, tokens: list[int], k: int | None) -> list[dict[int, Logprob] | None] | None:
    """Top-``k`` logprobs of each emitted token (row j's distribution for token j), None when not asked for; an
    ``INVALID_TOKEN`` gets None."""
    if k is None:
        return None
    valid = [t for t in tokens if t != INVALID_TOKEN]
    result: list[dict[int, Logprob] | None] = list(top_logprobs(logits[:len(valid)], valid, [k] * len(valid)))
    return result + [None] * (len(tokens) - len(valid))
