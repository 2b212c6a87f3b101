"""Tests written to kill mutants that mutation testing (``make mutate``, mutmut) showed the fast suite let live.
Each asserts a behaviour of the scheduler, policies, allocators, sampler or stop logic that a one-token change
to the code would alter; none needs the model."""

from __future__ import annotations

from nanovllm import Request, SamplingParams


def _request(n_prompt: int, max_tokens: int, **params) -> Request:
    return Request("r", list(range(1, 1 + n_prompt)), SamplingParams(max_tokens=max_tokens, **params), 0.0)


def test_a_request_stops_at_exactly_max_tokens_or_max_model_len():
    request = _request(3, max_tokens=3, ignore_eos=True)
    for _ in range(2):
        request.append_token(7, 0.0)
        assert request.check_stop(10**9) is None
    request.append_token(7, 0.0)
    assert request.check_stop(10**9) == "length"          # the third token is the last
    long = _request(3, max_tokens=100)
    long.append_token(7, 0.0)
    assert long.check_stop(5) is None and long.check_stop(4) == "length"   # 4 tokens reach a 4-token limit
