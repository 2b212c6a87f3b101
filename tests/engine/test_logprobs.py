"""SamplingParams(logprobs=k): per generated token, the top-k candidates and the chosen token with their
log-probabilities and ranks, as vLLM returns them."""

from __future__ import annotations

import math

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.outputs import Logprob
from nanovllm.sampling import top_logprobs


def test_top_logprobs_values_ranks_and_the_sampled_token():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 1.0]])
    result = top_logprobs(logits, tokens=[2, 0], ks=[2, None])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert result[1] is None
    assert list(result[0]) == [1, 3, 2]  # the top two in order, then the sampled token (rank 3)
    assert result[0][1] == Logprob(pytest.approx(float(expected[1])), 1)
    assert result[0][2].rank == 3 and math.isclose(result[0][2].logprob, float(expected[2]), rel_tol=1e-6)


def test_zero_logprobs_returns_only_the_sampled_token():
    result = top_logprobs(torch.tensor([[1.0, 2.0, 0.5]]), tokens=[0], ks=[0])
    assert list(result[0]) == [0] and result[0][0].rank == 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_logprobs_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="logprobs must be None or an integer >= 0"):
        SamplingParams(logprobs=bad)


def test_generate_returns_logprobs_matching_transformers(llm, hf_model, parity_prompts):
    prompt = parity_prompts[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=5), use_tqdm=False)[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the most likely token
        assert 5 <= len(entry) <= 6
        ranks = [lp.rank for lp in entry.values()]
        assert ranks == sorted(ranks)
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    top = reference.topk(5)
    assert list(out.logprobs[0]) == top.indices.tolist()
    ours = torch.tensor([lp.logprob for lp in out.logprobs[0].values()])
    torch.testing.assert_close(ours, top.values, atol=1e-4, rtol=1e-4)


def test_sampled_token_outside_the_top_k_is_still_reported(llm, parity_prompts):
    params = SamplingParams(temperature=1.5, max_tokens=24, seed=3, logprobs=1, ignore_eos=True)
    out = llm.generate([parity_prompts[9]], params, use_tqdm=False)[0]
    assert all(token in entry for token, entry in zip(out.token_ids, out.logprobs))
    off_top = [entry[token] for token, entry in zip(out.token_ids, out.logprobs) if entry[token].rank > 1]
    assert off_top and all(len(out.logprobs[i]) == 2 for i, t in enumerate(out.token_ids)
                           if out.logprobs[i][t].rank > 1)


def test_no_logprobs_unless_asked(llm, parity_prompts):
    out = llm.generate([parity_prompts[1]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.logprobs is None
