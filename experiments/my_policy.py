"""A user scheduling policy: shortest prompt first, with aging so that long prompts never starve.

    python -m nanovllm.run plugins=[experiments/my_policy.py] scheduler.name=shortest_prompt_first
    python -m nanovllm.run plugins=[experiments/my_policy.py] scheduler.name=shortest_prompt_first +scheduler.max_wait=2
"""

from nanovllm import Policy, register_policy


@register_policy("shortest_prompt_first")
class ShortestPromptFirst(Policy):
    """Admit short prompts first; a request that has waited over ``max_wait`` seconds goes ahead of them."""

    def __init__(self, max_wait: float = 5.0) -> None:
        self.max_wait = max_wait

    def priority(self, request, now):  # smaller runs first
        starving = now - request.arrival_time > self.max_wait
        return (not starving, request.num_prompt_tokens, request.arrival_time)
