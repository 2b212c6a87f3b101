"""The built-in ``ngram`` proposer (prompt lookup) on hand-made contexts."""

from __future__ import annotations

import pytest

from nanovllm import PROPOSERS, ProposerContext, SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.request import Request
from proposers.ngram import ngram_lookup


def test_the_tokens_after_the_most_recent_match_of_the_suffix_are_proposed():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 7, 8, 1, 2, 9, 4, 1, 2]
    # Suffix [1, 2] occurs at 1 and 5 (and is itself at 9): the most recent earlier one (5) is followed by 9, 4, 1.
    assert ngram_lookup(tokens, 3, 1, 2) == [9, 4, 1]


def test_the_longest_matching_suffix_wins_over_a_more_recent_shorter_one():
    tokens = [3, 1, 2, 6, 6, 0, 2, 7, 3, 1, 2]
    # [3, 1, 2] occurs at 0 (followed by 6, 6); the 1-gram [2] occurs more recently at 6 (followed by 7).
    assert ngram_lookup(tokens, 2, 1, 3) == [6, 6]
    assert ngram_lookup(tokens, 2, 1, 1) == [7, 3]


def test_at_most_num_tokens_and_no_more_than_the_context_holds():
    tokens = [1, 2, 3, 4, 1, 2]
    assert ngram_lookup(tokens, 1, 1, 2) == [3]
    assert ngram_lookup(tokens, 10, 1, 2) == [3, 4, 1, 2]
    # A match right before the suffix proposes what little follows it.
    assert ngram_lookup([4, 4, 4], 5, 1, 1) == [4]


def test_no_match_or_a_context_too_short_proposes_nothing():
    assert ngram_lookup([1, 2, 3, 4], 3, 1, 4) == []
    assert ngram_lookup([1, 2, 9, 1, 2], 3, 3, 4) == []       # only a 2-gram repeats, min is 3
    assert ngram_lookup([7], 3, 1, 4) == []
    assert ngram_lookup([1, 1], 0, 1, 4) == []


def test_the_registered_proposer_reads_the_whole_context_prompt_and_output():
    ngram = PROPOSERS.build({"name": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 2},
                            ProposerContext(EngineConfig(), None, None, vocab_size=100))
    request = Request("r", [10, 11, 12, 13, 14], SamplingParams(max_tokens=8), arrival_time=0.0)
    for token in (10, 11):   # output repeats the prompt's start
        request.append_token(token, 0.0)
    assert ngram.propose([request], [2]) == [[12, 13]]


@pytest.mark.parametrize("options", [dict(prompt_lookup_min=0), dict(prompt_lookup_max=2, prompt_lookup_min=3),
                                     dict(prompt_lookup_max=True)])
def test_bad_lookup_bounds_are_refused_naming_the_option(options):
    with pytest.raises(ValueError, match="speculative.prompt_lookup"):
        PROPOSERS.build({"name": "ngram", **options}, ProposerContext(EngineConfig(), None, None, vocab_size=100))
