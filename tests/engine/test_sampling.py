"""Sampling: parameters are validated (each at the edges of its documented range), the sampler draws from the
right distribution, seeds reproduce, and a request stops exactly when it should (max_tokens, max_model_len, EOS
unless ignored, stop token ids)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import make_request
from nanovllm import SamplingParams
from nanovllm import sampling as sampling_module
from nanovllm.sampling import INVALID_TOKEN, Sampler, greedy_tokens, top_logprobs


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


# -- when a request stops ----------------------------------------------------------------------------------------------

def test_a_request_stops_at_exactly_max_tokens_or_max_model_len():
    request = make_request("r", 3, max_tokens=3)
    for _ in range(2):
        request.append_token(7, 0.0)
        assert request.check_stop(10**9) is None
    request.append_token(7, 0.0)
    assert request.check_stop(10**9) == "length"          # the third token is the last
    long = make_request("r", 3, max_tokens=100, ignore_eos=False)
    long.append_token(7, 0.0)
    assert long.check_stop(5) is None and long.check_stop(4) == "length"   # 4 tokens reach a 4-token limit


def test_eos_stops_unless_ignored_and_logprobs_are_kept_per_token():
    request = make_request("r", 3, max_tokens=10, ignore_eos=False)
    request.eos_token_ids = frozenset({2})
    request.append_token(5, 0.0)                            # no logprobs asked: none kept
    assert request.logprobs is None
    request.append_token(2, 1.0, {2: "lp-a"})
    assert request.check_stop(10**9) == "stop"
    request.append_token(6, 2.0, {6: "lp-b"})
    assert request.logprobs == [{2: "lp-a"}, {6: "lp-b"}]


def test_stop_token_ids_stop_even_when_eos_is_ignored():
    request = make_request("r", 3, max_tokens=10, ignore_eos=True, stop_token_ids=[42])
    request.eos_token_ids = frozenset({2})
    request.append_token(2, 0.0)
    assert request.check_stop(10**9) is None               # EOS ignored
    request.append_token(42, 0.0)
    assert request.check_stop(10**9) == "stop"             # a stop id still stops


# -- the sampler and its parameters at their edges ---------------------------------------------------------------------

@pytest.mark.parametrize("field, good, bad", [
    ("temperature", [0, 0.0, 2.5], [-0.01, -0.1, math.inf, math.nan, True, "1"]),
    ("top_k", [-1, 1, 50], [0, -2, 2.0, True]),
    ("top_p", [1, 1.0, 0.01], [0, 0.0, 1.01, 1.5, math.nan, True]),
    ("max_tokens", [1, 64], [0, -1, 1.0, True]),
    ("ignore_eos", [True, False], [1, "yes", None]),
    ("stop_token_ids", [None, [], [0], (3, 4)], [[-1], ["a"], "5", 5, [True, 1.5]]),
    ("seed", [None, 0, 2**64 - 1], [-1, 2**64, 1.5, True]),
    ("logprobs", [None, 0, 5], [-1, True, 1.5]),
])
def test_sampling_params_accept_exactly_their_documented_range(field, good, bad):
    for value in good:
        SamplingParams(**{field: value})
    for value in bad:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})


def test_greedy_below_the_temperature_threshold_or_with_top_k_one():
    assert SamplingParams(temperature=0.99e-5).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=1e-5).greedy and not SamplingParams(temperature=1.0, top_k=2).greedy


def test_sampler_marks_non_finite_rows_and_samples_the_others_by_their_own_filters():
    logits = torch.tensor([[0.0, float("nan"), 1.0], [0.0, float("inf"), 1.0], [5.0, float("-inf"), 4.0],
                           [1.0, 1.0, 1.0], [1.0, 0.9, 0.0]])
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0),
              SamplingParams(top_k=-1), SamplingParams(top_k=2)]
    seen: list[set[int]] = [set() for _ in params]
    generators = [torch.Generator().manual_seed(i) for i in range(len(params))]
    for _ in range(300):
        for row, token in enumerate(Sampler()(logits, params, generators)):
            seen[row].add(token)
    assert seen[0] == seen[1] == {INVALID_TOKEN}
    assert seen[2] == {0}                                   # -inf is a legitimate "never this token"
    assert seen[3] == {0, 1, 2}                             # top_k=-1 keeps the whole row in a mixed batch
    assert seen[4] == {0, 1}                                # top_k=2 in the same batch


def test_sampler_top_k_beyond_the_vocabulary_keeps_everything_and_top_p_is_per_row():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    params = [SamplingParams(top_k=10, top_p=1.0), SamplingParams(top_p=0.5)]
    seen: list[set[int]] = [set(), set()]
    generators = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    for _ in range(400):
        for row, token in enumerate(Sampler()(logits, params, generators)):
            seen[row].add(token)
    assert seen == [{0, 1, 2}, {0}]


def test_each_row_draws_from_its_own_generator():
    logits = torch.zeros(2, 1000)
    params = [SamplingParams(seed=1), SamplingParams(seed=2)]
    first = Sampler()(logits, params, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
    again = Sampler()(logits, params, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(99)])
    assert first[0] == again[0] and first[1] != again[1]


def test_top_logprobs_rank_the_top_k_and_always_include_the_sampled_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    result = top_logprobs(logits, [3, 0, 1], [2, 0, None])
    expected = torch.log_softmax(logits, dim=-1)
    assert set(result[0]) == {0, 1, 3}
    assert [result[0][t].rank for t in (0, 1, 3)] == [1, 2, 4]
    assert result[0][3].logprob == pytest.approx(float(expected[0, 3]))
    assert result[0][0].logprob == pytest.approx(float(expected[0, 0]))
    assert set(result[1]) == {0} and result[1][0].rank == 4 and result[2] is None
    assert top_logprobs(logits, [0, 0, 0], [None, None, None]) == [None, None, None]


def test_top_logprobs_with_k_one_reports_the_argmax_first():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    [entry] = top_logprobs(logits, [2], [1])
    assert set(entry) == {1, 2} and (entry[1].rank, entry[2].rank) == (1, 2)


def test_top_p_drops_a_token_once_the_mass_before_it_reaches_top_p_exactly():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))    # exact in float32: masses before 0, 0.5, 0.75
    generator = torch.Generator().manual_seed(0)
    assert {Sampler()(logits, [SamplingParams(top_p=0.5)], [generator])[0] for _ in range(300)} == {0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_in_torch_ops_match_the_cpu_kernel_where_it_cannot_be_built(dtype, monkeypatch):
    """Off CPU, or where the C++ kernels cannot be built (no compiler), greedy_tokens runs in torch ops: the same
    argmax as the kernel (first index on ties; -inf is a legitimate logit), the same NaN / +inf row flags, and
    the sampler turns each flagged row into INVALID_TOKEN while the others keep their argmax."""
    vocab = 37
    torch.manual_seed(0)
    logits = (torch.randn(6, vocab) * 4).to(dtype)
    logits[1, 5] = float("nan")
    logits[2, vocab - 1] = float("inf")
    logits[3, :] = float("-inf")
    logits[3, 11] = 0.0                              # one finite logit among -inf
    logits[4, :] = 1.0                               # all tied: the first index
    logits[5, vocab - 1] = 1e4
    kernel_tokens, kernel_bad = greedy_tokens(logits)    # the C++ kernel on this CPU (built on first use)
    monkeypatch.setattr(sampling_module, "_cpu_kernels", lambda: None)
    tokens, bad = greedy_tokens(logits)
    assert bad.tolist() == kernel_bad.tolist() == [False, True, True, False, False, False]
    assert tokens[~bad].tolist() == kernel_tokens[~bad].tolist()
    assert tokens[0] == int(logits[0].float().argmax()) and tokens[3:].tolist() == [11, 0, vocab - 1]
    greedy = [SamplingParams(temperature=0.0) for _ in range(6)]
    sampled = Sampler()(logits, greedy, [torch.Generator() for _ in range(6)])
    assert sampled == [tokens[0].item(), INVALID_TOKEN, INVALID_TOKEN, 11, 0, vocab - 1]


def test_temperature_scales_logits_before_top_p_filters_them():
    # Logits 2, 1, 0: at temperature 1 the top token alone holds 0.665 >= top_p=0.6, so only it survives; at
    # temperature 10 the distribution is nearly flat and the nucleus keeps two tokens.
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=10.0, top_p=0.6)
    generator = torch.Generator().manual_seed(0)
    draws = {Sampler()(logits, [params], [generator])[0] for _ in range(200)}
    assert draws == {0, 1}
