"""Every registered proposer, built-in or not, keeps the seam's contract: at most the tokens it was allowed, each
a valid id. And the engine's side refuses a proposer that does not, naming it."""

from __future__ import annotations

import random

import pytest

from nanovllm import PROPOSERS, Proposer, ProposerContext, SamplingParams, register_proposer
from nanovllm.config import EngineConfig
from nanovllm.engine.speculative import Speculator
from nanovllm.proposer import ProposerError
from nanovllm.request import Request

VOCAB = 50


def _requests(seed: int) -> list[Request]:
    """Decoding requests over a small vocabulary: random, repetitive and constant contexts, each with output."""
    rng = random.Random(seed)
    contexts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 60))] for _ in range(6)]
    contexts += [[1, 2, 3] * 10, [4] * 9, [VOCAB - 1]]
    requests = []
    for i, context in enumerate(contexts):
        request = Request(str(i), context, SamplingParams(max_tokens=64), arrival_time=0.0)
        request.append_token(context[0], 0.0)
        request.num_computed_tokens = request.num_tokens - 1   # decoding: only the newest token is uncomputed
        requests.append(request)
    return requests


# Every proposer registered when the tests are collected, but the deliberately broken ones below (``test_``).
@pytest.mark.parametrize("name", [n for n in PROPOSERS.names() if not n.startswith("test_")])
@pytest.mark.parametrize("num_tokens", [1, 3, 8])
def test_every_registered_proposer_proposes_at_most_k_valid_ids(name, num_tokens):
    proposer = PROPOSERS.build(name, ProposerContext(EngineConfig(), None, None, vocab_size=VOCAB))
    for seed in range(5):
        requests = _requests(seed)
        limits = [random.Random(seed + i).randint(1, num_tokens) for i in range(len(requests))]
        proposals = proposer.propose(requests, limits)
        assert len(proposals) == len(requests)
        for tokens, limit in zip(proposals, limits):
            assert len(tokens) <= limit
            assert all(isinstance(t, int) and 0 <= t < VOCAB for t in tokens)
    # Repetition is what prompt lookup is for: something is proposed there.
    if name == "ngram":
        assert any(proposer.propose(_requests(0), [num_tokens] * 9))


@register_proposer("test_too_many")
class _TooMany(Proposer):
    def propose_one(self, request, num_tokens):
        return [0] * (num_tokens + 1)


@register_proposer("test_out_of_vocab")
class _OutOfVocab(Proposer):
    def propose_one(self, request, num_tokens):
        return [VOCAB]


@pytest.mark.parametrize("name, message", [("test_too_many", "at most 2 allowed"),
                                           ("test_out_of_vocab", r"integers in \[0, 50\)")])
def test_the_engine_refuses_a_proposer_that_breaks_the_contract(name, message):
    config = EngineConfig(speculative=dict(method=name, num_speculative_tokens=2))
    speculator = Speculator(config, ProposerContext(config, None, None, vocab_size=VOCAB))
    with pytest.raises(ProposerError, match=f"proposer {name!r}.*{message}"):
        speculator.propose(_requests(0), max_model_len=1000)


def test_proposals_are_capped_so_no_accepted_run_passes_max_tokens_or_the_model_length():
    config = EngineConfig(speculative=dict(method="ngram", num_tokens=5))
    assert config.speculative["num_speculative_tokens"] == 5
    speculator = Speculator(config, ProposerContext(config, None, None, vocab_size=VOCAB))
    request = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=4), arrival_time=0.0)
    request.append_token(3, 0.0)
    request.num_computed_tokens = request.num_tokens - 1
    speculator.propose([request], max_model_len=1000)
    assert request.spec_token_ids == [1, 2]          # 3 tokens left: 2 proposals + the target's own
    speculator.propose([request], max_model_len=request.num_tokens + 2)
    assert request.spec_token_ids == [1]             # the model's length leaves room for 2 tokens
    request.num_computed_tokens -= 1                 # a prefill chunk, not a decode: nothing proposed
    speculator.propose([request], max_model_len=1000)
    assert request.spec_token_ids == []


@pytest.mark.parametrize("spec, message", [
    (dict(method="ngram"), r"num_speculative_tokens \(num_tokens\) must be an integer >= 1"),
    (dict(method="ngram", num_speculative_tokens=0), r"num_speculative_tokens \(num_tokens\) must be an integer >= 1"),
    (dict(method="ngram", num_tokens=2, num_speculative_tokens=3), "same setting"),
    ("ngram", "must be None or a mapping"),
])
def test_bad_speculative_settings_are_refused_naming_the_field(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative=spec)


def test_method_none_is_speculation_off():
    assert EngineConfig(speculative=dict(method=None, num_tokens=3)).speculative is None

