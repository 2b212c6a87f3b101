"""Verification of proposals on given logits: greedy keeps exactly what one-at-a-time decoding would produce,
and rejection sampling emits every token with the target's own probabilities (a chi-square test)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from nanovllm import SamplingParams
from nanovllm.engine.speculative import emitted_logprobs, verify_proposals
from nanovllm.sampling import INVALID_TOKEN, Sampler

GREEDY = SamplingParams(temperature=0.0)


def _logits(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(1))
    for row, token in enumerate(argmaxes):
        logits[row, token] = 10.0
    return logits


@pytest.mark.parametrize("proposals, emitted", [
    ([3, 5], [3, 5, 2]),      # all accepted, then the bonus token
    ([3, 4], [3, 5]),         # the second is rejected: the target's own token replaces it
    ([1, 5], [3]),            # the first is rejected: one token, as a plain decode step
])
def test_greedy_accepts_the_longest_prefix_equal_to_the_argmax_and_adds_the_targets_token(proposals, emitted):
    generator = torch.Generator().manual_seed(0)
    assert verify_proposals(_logits([3, 5, 2]), proposals, GREEDY, generator) == emitted


def test_a_non_finite_row_ends_the_run_with_the_invalid_token():
    logits = _logits([3, 5, 2])
    logits[1, 0] = float("nan")
    assert verify_proposals(logits, [3, 5], GREEDY, torch.Generator()) == [3, INVALID_TOKEN]
    # Past a rejection the bad row is never read.
    assert verify_proposals(logits, [1, 5], GREEDY, torch.Generator()) == [3]


def test_logprobs_of_each_emitted_token_come_from_its_own_row():
    logits = _logits([3, 5, 2])
    lps = emitted_logprobs(logits, [3, 5], 2)
    expected = torch.log_softmax(logits, dim=-1)
    assert [set(lp) for lp in lps] == [{3, int(expected[0].topk(2).indices[1])}, {5, int(expected[1].topk(2).indices[1])}]
    assert lps[1][5].logprob == pytest.approx(float(expected[1, 5]), abs=1e-6) and lps[1][5].rank == 1
    assert emitted_logprobs(logits, [3, 5], None) is None


SAMPLES = 8_000


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)])
def test_rejection_sampling_emits_each_token_with_the_targets_probabilities(params):
    vocab = 8
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    target = Sampler._probabilities(logits, [params] * 3).double()
    # Proposals the target likes (d1) and one it dislikes (d2): both acceptance and rejection happen often.
    d1, d2 = int(target[0].argmax()), int(target[1].argmin())
    generator = torch.Generator().manual_seed(0)
    first = torch.zeros(vocab)
    second_after_d1 = torch.zeros(vocab)
    for _ in range(SAMPLES):
        out = verify_proposals(logits, [d1, d2], params, generator)
        first[out[0]] += 1
        if out[0] == d1:
            second_after_d1[out[1]] += 1

    def p_value(observed: torch.Tensor, probs: torch.Tensor) -> float:
        keep = probs > 0   # top-k: tokens the target never emits must never appear
        assert observed[~keep].sum() == 0
        expected = probs[keep] / probs[keep].sum() * observed[keep].sum()
        return chisquare(observed[keep].numpy(), expected.numpy()).pvalue

    assert p_value(first, target[0]) > 1e-3
    assert p_value(second_after_d1, target[1]) > 1e-3
    # The test can tell a wrong distribution: always accepting d1 would put all of the first token's mass on it.
    assert p_value(first, torch.nn.functional.one_hot(torch.tensor(d1), vocab).double() * 0.5 + target[0] * 0.5) < 1e-6


def test_a_seeded_request_verifies_reproducibly():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0.9, seed=7)
    runs = [[verify_proposals(logits, [1, 2, 3], params, generator) for _ in range(50)]
            for generator in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))]
    assert runs[0] == runs[1]
