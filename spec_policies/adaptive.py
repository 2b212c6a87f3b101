"""``adaptive``: goodput-driven proposal length, after SmartSpec (Liu et al., 2024). Each step, for each decoding
request, the K in 0..K_max that maximises the batch's expected tokens per second.

The model. A request whose proposals are accepted at rate ``a`` (each proposal independently, the verification
stopping at the first rejection) emits, per verification of K proposals, ``E(K) = 1 + a + ... + a^K =
(1 - a^(K+1)) / (1 - a)`` tokens (``K + 1`` when ``a = 1``). A decode step computing ``n`` tokens takes
``T(n) = fixed + per_token * n``. With ``n`` requests decoding, giving this request K proposals makes the step
compute ``n + K`` tokens for ``n - 1 + E(K)`` expected tokens (each decision is taken as if the other requests
propose nothing), so the policy returns ``argmax_K (n - 1 + E(K)) / T(n + K)``, the smallest K on a tie. A
larger batch makes the same K cost more of everyone's time, so speculation turns down under load; a request
whose proposals are rejected gains nothing from them and gets K = 0.

``a`` is estimated per request as the model defines it: each proposal verified is accepted with probability ``a``
until the first rejection, and the proposals after a rejection are never judged. So the estimate is the accepted
proposals over the accepted ones plus the rejections (``num_accepted_tokens / (num_accepted_tokens +
num_rejected_drafts)``), not over every proposal verified: that ratio counts the unjudged proposals after a
rejection as rejected too, and under-reads ``a`` by more the longer the proposals (on copy prompts, K = 3, it
read 0.57 where verifications emitted 2.6 tokens, what ``a`` ~ 0.78 gives). It is smoothed with a prior of
``prior_weight`` judged proposals at ``prior_acceptance``, so that a new request speculates and one early
rejection does not switch it off for good (a request that never gets accepted drifts to 0).
``T`` is fitted by the engine to its own recent decode steps (``SpeculationState.step_cost``); ``token_cost``
instead fixes ``per_token / fixed``, and ``default_token_cost`` is that ratio until the engine has measured one.
"""

from __future__ import annotations

from nanovllm import Request, SpeculationPolicy, SpeculationState, StepCost, register_spec_policy


def expected_tokens(acceptance: float, num_tokens: int) -> float:
    """Tokens one verification of ``num_tokens`` proposals emits in expectation, at per-proposal acceptance
    ``acceptance``: the accepted run plus the target's own token."""
    if acceptance >= 1.0:
        return float(num_tokens + 1)
    return (1.0 - acceptance ** (num_tokens + 1)) / (1.0 - acceptance)


@register_spec_policy("adaptive")
class AdaptivePolicy(SpeculationPolicy):
    """``token_cost``: seconds per verified token over a step's fixed seconds (None: measured by the engine);
    ``default_token_cost``: that ratio until measured; ``prior_acceptance`` / ``prior_weight``: the acceptance
    assumed for a request before its proposals are counted, and how many proposed tokens it weighs."""

    def __init__(self, token_cost: float | None = None, default_token_cost: float = 0.05,
                 prior_acceptance: float = 0.5, prior_weight: float = 3.0) -> None:
        for name, value in (("token_cost", token_cost), ("default_token_cost", default_token_cost),
                            ("prior_weight", prior_weight)):
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0):
                raise ValueError(f"speculative.policy.{name} must be a number >= 0, got {value!r}")
        if not isinstance(prior_acceptance, (int, float)) or not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError(f"speculative.policy.prior_acceptance must be in [0, 1], got {prior_acceptance!r}")
        self.token_cost = token_cost
        self.default_token_cost = default_token_cost
        self.prior_acceptance = float(prior_acceptance)
        self.prior_weight = float(prior_weight)

    def acceptance(self, request: Request) -> float:
        """The request's per-proposal acceptance probability: its accepted proposals over those judged (accepted
        ones and rejections), smoothed by the prior (the module docstring)."""
        weight = self.prior_weight
        judged = request.num_accepted_tokens + request.num_rejected_drafts
        if judged + weight == 0:
            return self.prior_acceptance
        return (request.num_accepted_tokens + self.prior_acceptance * weight) / (judged + weight)

    def step_cost(self, state: SpeculationState) -> StepCost:
        """The step-cost model in use: the configured ratio, else the engine's measurement, else the default."""
        if self.token_cost is not None:
            return StepCost(1.0, float(self.token_cost))
        if state.step_cost is not None:
            return state.step_cost
        return StepCost(1.0, float(self.default_token_cost))

    def num_speculative_tokens(self, request: Request, state: SpeculationState) -> int:
        a = self.acceptance(request)
        cost = self.step_cost(state)
        n = max(1, state.num_decoding)
        best_k, best = 0, -1.0
        for k in range(state.max_num_tokens + 1):
            seconds = cost.seconds(n + k)
            goodput = (n - 1 + expected_tokens(a, k)) / seconds if seconds > 0 else float("inf")
            if goodput > best:
                best_k, best = k, goodput
        return best_k
