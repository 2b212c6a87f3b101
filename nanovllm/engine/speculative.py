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
from nanovllm.outputs import Logprob
from nanovllm.proposer import PROPOSERS, Proposer, ProposerContext, ProposerError, proposer_spec
from nanovllm.request import Request
from nanovllm.sampling import INVALID_TOKEN, Sampler, SamplingParams, greedy_tokens, top_logprobs


class Speculator:
    """The engine's side of speculation: the proposer of ``EngineConfig.speculative`` and the number of tokens
    it may propose per request and step (``num_speculative_tokens``, capped so that no accepted run can pass
    the request's ``max_tokens`` or the model's length)."""

    def __init__(self, config: EngineConfig, context: ProposerContext) -> None:
        assert config.speculative is not None
        self.num_tokens: int = config.speculative["num_speculative_tokens"]
        self.proposer: Proposer = PROPOSERS.build(proposer_spec(config.speculative), context)
        self.vocab_size = context.vocab_size

    def propose(self, running: Sequence[Request], max_model_len: int) -> None:
        """Before the scheduler plans a step: set ``spec_token_ids`` of every running request (empty for those
        that do not decode this step or may not get more tokens)."""
        requests: list[Request] = []
        limits: list[int] = []
        for request in running:
            request.spec_token_ids = []
            limit = self._limit(request, max_model_len)
            if limit > 0:
                requests.append(request)
                limits.append(limit)
        if not requests:
            return
        name = self.proposer.registered_name
        try:
            proposals = self.proposer.propose(requests, limits)
        except Exception as exc:
            raise ProposerError(f"proposer {name!r} raised in propose(): {type(exc).__name__}: {exc}") from exc
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

    def _limit(self, request: Request, max_model_len: int) -> int:
        """How many tokens ``request`` may have proposed now: 0 unless it decodes (only its newest token is not
        in the cache, and it has output already); at most as many as could still be emitted after the target's
        own token, so that verification never writes K/V past ``max_tokens`` or the model's length."""
        if request.num_uncomputed_tokens != 1 or request.num_output_tokens == 0 or request.hand_off_after_prefill:
            return 0
        left = min(request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens)
        return max(0, min(self.num_tokens, left - 1))

    def on_finish(self, requests: Sequence[Request]) -> None:
        """Requests ended this step: the proposer forgets them."""
        for request in requests:
            request.spec_token_ids = []
            self.proposer.on_finish(request)


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
