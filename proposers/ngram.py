"""Prompt lookup (n-gram) speculation, vLLM's ``method="ngram"``: the request's own context proposes.

The last ``n`` tokens of the request (prompt + output so far) are looked up earlier in that context, for ``n``
from ``prompt_lookup_max`` down to ``prompt_lookup_min``; at the longest ``n`` that matches, the most recent
match proposes the tokens that followed it. Free to compute and no model to load; it pays off when the output
copies from the prompt (code editing, quoting, summarising) or repeats itself.
"""

from __future__ import annotations

import numpy as np

from nanovllm import Proposer, ProposerContext, Request, register_proposer


@register_proposer("ngram")
class NgramProposer(Proposer):
    """``prompt_lookup_max`` / ``prompt_lookup_min``: the longest and shortest suffix looked up (vLLM's names)."""

    def __init__(self, context: ProposerContext, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1) -> None:
        super().__init__(context)
        for name, value in (("prompt_lookup_max", prompt_lookup_max), ("prompt_lookup_min", prompt_lookup_min)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative.{name} must be an integer >= 1, got {value!r}")
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(f"speculative.prompt_lookup_min ({prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min

    def propose_one(self, request: Request, num_tokens: int) -> list[int]:
        return ngram_lookup(request.token_ids, num_tokens, self.prompt_lookup_min, self.prompt_lookup_max)


def ngram_lookup(tokens: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the most recent earlier occurrence of the longest suffix of
    ``tokens`` of ``max_n`` down to ``min_n`` tokens; [] when none occurs."""
    length = len(tokens)
    if num_tokens < 1 or length < min_n + 1:
        return []
    context = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length-n-1: each has at least one token after it, and none is the suffix.
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
        hits = np.flatnonzero((windows == context[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return context[start:start + num_tokens].tolist()
    return []
