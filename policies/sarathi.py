"""Stall-free batching (Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", OSDI 2024).

Every step computes at most ``token_budget`` tokens: running decodes first (so they never stall behind a long
prompt), then the next chunks of running prefills, then new prefills chunked into what is left. A fixed budget
bounds every step's duration, hence each decode's inter-token latency, at the price of stretching prefills over
several steps. Order within each group is first come, first served. Contrast: ``prefill_first``."""

from __future__ import annotations

from nanovllm import Policy, SchedulerView, StepBudget, register_policy


@register_policy("sarathi")
class SarathiServe(Policy):
    def __init__(self, token_budget: int = 256) -> None:
        if not isinstance(token_budget, int) or isinstance(token_budget, bool) or token_budget < 1:
            raise ValueError(f"scheduler.token_budget must be an integer >= 1 (tokens per step), got {token_budget!r}")
        self.token_budget = token_budget

    def step_budget(self, view: SchedulerView, now: float) -> StepBudget:
        return StepBudget(min(self.token_budget, view.max_num_batched_tokens), decodes_first=True)
