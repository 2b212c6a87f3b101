"""Speculation policies (``nanovllm.spec_policy``): every registered policy keeps the seam's contract (an int in
[0, K]); each built-in shows its defining effect, on its own and in the real engine; and greedy output stays
identical to decoding without speculation whatever the policy (float32, torch attention)."""

from __future__ import annotations

import functools
import random

import pytest

from nanovllm import (LLM, SPEC_POLICIES, SamplingParams, SpeculationPolicy, SpeculationState, StepCost,
                      register_spec_policy)
from nanovllm.config import EngineConfig
from nanovllm.engine.speculative import Speculator, StepCostFit
from nanovllm.proposer import ProposerContext, ProposerError
from nanovllm.request import Request
from spec_policies.adaptive import expected_tokens


def _request(drafted: int = 0, accepted: int = 0, seed: int = 0) -> Request:
    """A decoding request whose proposals so far were ``accepted`` of ``drafted``, three a verification, the
    accepted ones filling as few verifications as they can (the rest each ended on a rejection)."""
    rng = random.Random(seed)
    context = [rng.randrange(50) for _ in range(rng.randrange(2, 40))]
    request = Request(str(seed), context, SamplingParams(max_tokens=64), arrival_time=0.0)
    request.append_token(context[0], 0.0)
    request.num_computed_tokens = request.num_tokens - 1
    request.num_drafts, request.num_draft_tokens, request.num_accepted_tokens = drafted // 3, drafted, accepted
    request.num_rejected_drafts = drafted // 3 - accepted // 3
    return request


def _states(k: int) -> list[SpeculationState]:
    costs = [None, StepCost(0.02, 0.0), StepCost(0.02, 0.001), StepCost(0.0, 0.01), StepCost(0.01, 1.0)]
    return [SpeculationState(num_running=n, num_decoding=d, max_num_tokens=k, step_cost=cost)
            for n, d in ((1, 1), (4, 2), (16, 16), (256, 200)) for cost in costs]


# Every policy registered when the tests are collected, built with its default options, but the broken ones below.
@pytest.mark.parametrize("name", [n for n in SPEC_POLICIES.names() if not n.startswith("test_")])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_every_registered_policy_returns_an_int_between_0_and_k(name, k):
    policy = SPEC_POLICIES.build(name)
    for state in _states(k):
        for drafted, accepted in ((0, 0), (30, 0), (30, 30), (30, 12)):
            n = policy.num_speculative_tokens(_request(drafted, accepted), state)
            assert isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= k, (name, state, n)


def test_fixed_gives_k_or_its_own_smaller_number():
    state = SpeculationState(num_running=64, num_decoding=64, max_num_tokens=5)
    assert SPEC_POLICIES.build("fixed").num_speculative_tokens(_request(30, 0), state) == 5
    assert SPEC_POLICIES.build(dict(name="fixed", num_tokens=2)).num_speculative_tokens(_request(), state) == 2
    assert SPEC_POLICIES.build(dict(name="fixed", num_tokens=9)).num_speculative_tokens(_request(), state) == 5


def test_off_above_batch_turns_off_only_when_the_running_batch_exceeds_b():
    policy = SPEC_POLICIES.build(dict(name="off_above_batch", max_batch=4))
    ks = [policy.num_speculative_tokens(_request(), SpeculationState(n, n, 3)) for n in range(1, 8)]
    assert ks == [3, 3, 3, 3, 0, 0, 0]


def test_expected_tokens_is_the_geometric_sum_of_accepted_runs():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_adaptive_turns_down_a_request_that_is_never_accepted_and_keeps_k_for_one_always_accepted():
    policy = SPEC_POLICIES.build("adaptive")
    state = SpeculationState(num_running=1, num_decoding=1, max_num_tokens=4, step_cost=StepCost(0.02, 0.001))
    assert policy.num_speculative_tokens(_request(drafted=180, accepted=0), state) == 0   # 60 rejections
    assert policy.num_speculative_tokens(_request(drafted=60, accepted=60), state) == 4
    # A new request speculates on the prior; a single early rejection does not switch it off.
    assert policy.num_speculative_tokens(_request(), state) > 0
    assert policy.num_speculative_tokens(_request(drafted=3, accepted=0), state) > 0


def test_adaptive_reads_the_per_proposal_acceptance_its_model_assumes_not_the_share_of_proposals_accepted():
    """Verifications of 3 proposals, each accepted with probability 0.8 until the first rejection (the model's
    own assumption): the policy's estimate finds 0.8, where accepted over verified proposals reads ~0.65 (the
    proposals after a rejection are never judged), and so it gives such a request more tokens."""
    rng = random.Random(0)
    request = _request()
    for _ in range(2000):
        accepted = next((j for j in range(3) if rng.random() >= 0.8), 3)
        request.num_drafts += 1
        request.num_draft_tokens += 3
        request.num_accepted_tokens += accepted
        request.num_rejected_drafts += accepted < 3
    policy = SPEC_POLICIES.build("adaptive")
    assert policy.acceptance(request) == pytest.approx(0.8, abs=0.02)
    assert request.num_accepted_tokens / request.num_draft_tokens == pytest.approx((0.8 + 0.64 + 0.512) / 3,
                                                                                   abs=0.02)


def test_adaptive_turns_down_under_load_when_verification_costs_more_of_everyones_time():
    policy = SPEC_POLICIES.build("adaptive")
    cost = StepCost(0.02, 0.002)   # a verified token costs a tenth of a step's fixed cost
    request = _request(drafted=60, accepted=40)
    alone = policy.num_speculative_tokens(request, SpeculationState(1, 1, 4, cost))
    busy = policy.num_speculative_tokens(request, SpeculationState(64, 64, 4, cost))
    assert alone == 4 and busy == 0
    # With the cost fixed by an option instead of measured, the measurement is ignored.
    pricey = SPEC_POLICIES.build(dict(name="adaptive", token_cost=10.0))
    assert pricey.num_speculative_tokens(request, SpeculationState(1, 1, 4, cost)) == 0


def test_the_step_cost_fit_recovers_a_linear_step_time_and_waits_for_a_slope():
    fit = StepCostFit()
    for _ in range(10):
        fit.observe(4, 0.05 + 0.004 * 4)
    assert fit.estimate() is None   # one size only: no slope
    for n in (1, 2, 3, 5, 8, 1, 6):
        fit.observe(n, 0.05 + 0.004 * n)
    cost = fit.estimate()
    assert cost is not None
    assert cost.fixed == pytest.approx(0.05) and cost.per_token == pytest.approx(0.004)


@register_spec_policy("test_too_many")
class _TooMany(SpeculationPolicy):
    def num_speculative_tokens(self, request, state):
        return state.max_num_tokens + 1


@register_spec_policy("test_raises")
class _Raises(SpeculationPolicy):
    def num_speculative_tokens(self, request, state):
        raise RuntimeError("boom")


@pytest.mark.parametrize("name, message", [("test_too_many", "must return an integer in .0, 3., got 4"),
                                           ("test_raises", "raised in num_speculative_tokens.*boom")])
def test_the_engine_refuses_a_policy_that_breaks_the_contract_naming_it(name, message):
    config = EngineConfig(speculative=dict(method="ngram", num_speculative_tokens=3, policy=name))
    speculator = Speculator(config, ProposerContext(config, None, None, vocab_size=50))
    with pytest.raises(ProposerError, match=f"speculation policy '{name}'.*{message}"):
        speculator.propose([_request(seed=1)], max_model_len=1024)


# -- the real engine ---------------------------------------------------------------------------------------------

BASE = dict(dtype="float32", attention="torch", max_model_len=512, warmup=False, max_num_seqs=6)
LIST = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango"
PROMPTS = [
    f"Repeat this list exactly: {LIST}. Again: {LIST}. Again:",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4,",
    "The quick brown fox",
    "In 1905, Albert Einstein published four papers that",
]
# Lengths differ so that the batch drains: the long copying request decodes alone at the end.
GREEDY = [SamplingParams(temperature=0.0, max_tokens=n) for n in (40, 24, 12, 12)]
POLICIES = {"fixed": "fixed", "off_above_batch": dict(name="off_above_batch", max_batch=2), "adaptive": "adaptive"}


@functools.cache
def _llm(policy: str | None) -> LLM:
    spec = None if policy is None else dict(method="ngram", num_speculative_tokens=3, policy=POLICIES[policy])
    return LLM(**BASE, speculative=spec)


@functools.cache
def _plain() -> list[list[int]]:
    return [o.token_ids for o in _llm(None).generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_output_is_identical_to_no_speculation_under_every_policy(policy):
    assert set(POLICIES) == {n for n in SPEC_POLICIES.names() if not n.startswith("test_")}
    llm = _llm(policy)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == _plain()
    assert sum(s["spec_decode_num_accepted_tokens"] for s in llm.last_steps) > 0


@pytest.mark.slow
def test_off_above_batch_proposes_nothing_in_steps_where_the_batch_exceeds_b():
    llm = _llm("off_above_batch")   # max_batch 2, four requests of different lengths
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    steps = llm.last_steps
    crowded = [s for s in steps if s["num_decode_seqs"] > 2]
    assert crowded and all(s["spec_decode_num_draft_tokens"] == 0 for s in crowded)
    # Once the batch drains to B or fewer, the survivors speculate again.
    assert any(s["spec_decode_num_draft_tokens"] > 0 for s in steps if s["num_decode_seqs"] <= 2)


@pytest.mark.slow
def test_adaptive_proposes_nothing_when_told_verification_is_dear_and_keeps_proposing_on_copying_text():
    dear = LLM(**BASE, speculative=dict(method="ngram", num_speculative_tokens=3,
                                        policy=dict(name="adaptive", token_cost=10.0)))
    outputs = dear.generate(PROMPTS[:2], GREEDY[:2], use_tqdm=False)
    assert [o.token_ids for o in outputs] == _plain()[:2]
    assert sum(s["spec_decode_num_draft_tokens"] for s in dear.last_steps) == 0
    llm = _llm("adaptive")
    copying = llm.generate(PROMPTS[:1], GREEDY[:1], use_tqdm=False)[0].metrics
    assert copying.spec_decode_num_accepted_tokens >= 0.5 * copying.spec_decode_num_draft_tokens > 0
