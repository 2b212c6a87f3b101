"""Sampling: parameters are validated, the sampler draws from the right distribution, seeds reproduce."""

from __future__ import annotations

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.sampling import Sampler


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
     ({"max_tokens": 0}, "max_tokens"), ({"top_k": 0}, "top_k"), ({"stop_token_ids": ["a"]}, "stop_token_ids")],
)
def test_bad_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def _draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    sampler = Sampler()
    g = torch.Generator().manual_seed(seed)
    batch = logits.expand(n, -1)
    return torch.tensor(sampler(batch, [params] * n, [g] * n))


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 20000
    for temperature in (0.5, 1.0, 2.0):
        draws = _draw(logits, SamplingParams(temperature=temperature), n)
        freq = torch.bincount(draws, minlength=5).float() / n
        expected = (logits[0] / temperature).softmax(-1)
        # 5 standard errors of a binomial proportion: fails only on a real distribution error.
        tolerance = 5 * (expected * (1 - expected) / n).sqrt()
        assert ((freq - expected).abs() <= tolerance).all(), (temperature, freq, expected)
    hot = _draw(logits, SamplingParams(temperature=2.0), n)
    cold = _draw(logits, SamplingParams(temperature=0.5), n)
    assert (hot != 0).sum() > (cold != 0).sum()  # higher temperature spreads the mass


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    top_k = _draw(logits, SamplingParams(temperature=1.0, top_k=2), 4000)
    assert set(top_k.tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # [0.63, 0.23, 0.09, ...]: top_p=0.8 keeps tokens 0 and 1
    top_p = _draw(logits, SamplingParams(temperature=1.0, top_p=0.8), 4000)
    assert set(top_p.tolist()) == {0, 1}, probs
    assert _draw(logits, SamplingParams(temperature=1.0, top_p=0.5), 200).eq(0).all()


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(top_k=1),
              SamplingParams(temperature=0)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    tokens = Sampler()(logits, params, gens)
    argmax = logits.argmax(-1).tolist()
    assert [tokens[0], tokens[2], tokens[3]] == [argmax[0], argmax[2], argmax[3]]


def test_engine_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llm):
    prompts = ["Tell me a story about a dragon.", "List three colors:", "The meaning of life is"]
    seeded = [SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=16, ignore_eos=True) for i in range(3)]
    first = [o.token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
    # The same seeds, submitted in another order and batch, give the same tokens: each request has its own stream.
    second = [o.token_ids for o in llm.generate(prompts[::-1], seeded[::-1], use_tqdm=False)][::-1]
    assert first == second
    other = [o.token_ids for o in llm.generate(prompts, [SamplingParams(temperature=1.0, seed=99 + i, max_tokens=16,
                                                                        ignore_eos=True) for i in range(3)],
                                               use_tqdm=False)]
    assert other != first
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)]
    top1 = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.8, top_k=1, max_tokens=16),
                                              use_tqdm=False)]
    assert top1 == greedy


def test_integer_temperature_and_top_k_past_int64_sample_every_token():
    """A temperature or top_k that is a valid Python int too large for int64 (found by test_fuzz) must not break
    the step: 2**63 flattens the distribution and keeps every token, so all tokens are drawn."""
    logits = torch.tensor([[4.0, 2.0, 0.0, -2.0]])
    params = SamplingParams(temperature=2**63, top_k=2**63)
    params.validate()
    draws = _draw(logits, params, 4000)
    assert set(draws.tolist()) == {0, 1, 2, 3}
