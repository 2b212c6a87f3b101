"""First come, first served: the engine's default and the base ``Policy``'s behaviour."""

from nanovllm import Policy, register_policy


@register_policy("fcfs")
class FCFS(Policy):
    """Admit by arrival time; under memory pressure preempt the latest arrival."""
