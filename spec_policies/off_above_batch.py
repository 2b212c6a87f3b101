"""``off_above_batch``: speculate only while the batch is small. Verifying proposals costs compute that a large
batch already saturates, so above ``max_batch`` running requests every request decodes one token per step."""

from __future__ import annotations

from nanovllm import Request, SpeculationPolicy, SpeculationState, register_spec_policy


@register_spec_policy("off_above_batch")
class OffAboveBatchPolicy(SpeculationPolicy):
    """``max_batch``: the largest running batch that still speculates (with ``num_speculative_tokens`` each)."""

    def __init__(self, max_batch: int = 8) -> None:
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 0:
            raise ValueError(f"speculative.policy.max_batch must be an integer >= 0, got {max_batch!r}")
        self.max_batch = max_batch

    def num_speculative_tokens(self, request: Request, state: SpeculationState) -> int:
        return 0 if state.num_running > self.max_batch else state.max_num_tokens
