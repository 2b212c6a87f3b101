"""``fixed``: every decoding request may get the same number of proposed tokens every step (the default)."""

from __future__ import annotations

from nanovllm import Request, SpeculationPolicy, SpeculationState, register_spec_policy


@register_spec_policy("fixed")
class FixedPolicy(SpeculationPolicy):
    """``num_tokens``: tokens proposed per request and step (None: the config's ``num_speculative_tokens``;
    larger values are capped at it)."""

    def __init__(self, num_tokens: int | None = None) -> None:
        if num_tokens is not None and (not isinstance(num_tokens, int) or isinstance(num_tokens, bool)
                                       or num_tokens < 0):
            raise ValueError(f"speculative.policy.num_tokens must be null or an integer >= 0, got {num_tokens!r}")
        self.num_tokens = num_tokens

    def num_speculative_tokens(self, request: Request, state: SpeculationState) -> int:
        if self.num_tokens is None:
            return state.max_num_tokens
        return min(self.num_tokens, state.max_num_tokens)
