"""Prefill-prioritizing scheduling, the contrast to stall-free batching (vLLM's original scheduler and Orca, as
characterised in Sarathi-Serve, Agrawal et al., OSDI 2024, section 3).

Whenever a prompt can be admitted (or a running one has prefill left), the step runs prefills only, each
whole where ``max_num_batched_tokens`` allows; running decodes wait for a step with no prefill work. This
maximises early admission (good TTFT, good throughput) and causes generation stalls: every arriving long
prompt pauses all ongoing decodes, which shows in p99 TPOT / inter-token latency."""

from __future__ import annotations

from nanovllm import Policy, SchedulerView, StepBudget, register_policy


@register_policy("prefill_first")
class PrefillFirst(Policy):
    def step_budget(self, view: SchedulerView, now: float) -> StepBudget:
        return StepBudget(view.max_num_batched_tokens, decodes_first=False)
