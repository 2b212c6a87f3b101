"""The prompt-id check ``make_request`` runs on every request: its fast path (all plain ints, checked in C)
must accept and refuse exactly what the per-token rule does, bools, floats, int subclasses and mixed lists
included."""

from __future__ import annotations

import enum

from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.engine.engine import _token_ids_in_range

VOCAB = 1000


class _Token(enum.IntEnum):   # an int subclass that is not bool: accepted, as before
    A = 3
    B = 2000


def _per_token_rule(token_ids: list, vocab_size: int) -> bool:
    """The rule as it was written before the fast path: one Python test per token."""
    return not any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in token_ids)


items = st.one_of(st.integers(-3, VOCAB + 3), st.booleans(), st.floats(-2, VOCAB + 2, allow_nan=False),
                  st.sampled_from([_Token.A, _Token.B, "7", None]))


@settings(max_examples=400, deadline=None)
@given(st.lists(items, min_size=1, max_size=12) | st.lists(st.integers(-1, VOCAB), min_size=1, max_size=50))
def test_fast_check_matches_the_per_token_rule(token_ids: list) -> None:
    assert _token_ids_in_range(token_ids, VOCAB) is _per_token_rule(token_ids, VOCAB)


def test_edges() -> None:
    assert _token_ids_in_range([0, VOCAB - 1], VOCAB)
    assert not _token_ids_in_range([0, VOCAB], VOCAB)
    assert not _token_ids_in_range([-1, 5], VOCAB)
    assert not _token_ids_in_range([1, True], VOCAB)      # bool is an int to Python, never a token id here
    assert not _token_ids_in_range([1, 2.0], VOCAB)
    assert _token_ids_in_range([1, _Token.A], VOCAB)
    assert not _token_ids_in_range([1, _Token.B], VOCAB)
