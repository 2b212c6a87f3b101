"""Property tests (hypothesis) over the public inputs: ``SamplingParams`` fields of any type and value, prompts
(random unicode, huge strings, token-id lists with out-of-range, negative or non-int items), per-prompt lists of
the wrong length, priorities of the wrong type. Every case either runs or raises ``ValueError`` naming the
field; never a hang or a crash deep in torch, and never a corrupted engine: after every case a valid greedy
request still produces the same tokens as before, and every block is free."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm import SamplingParams

FIELDS = ["temperature", "top_k", "top_p", "max_tokens", "ignore_eos", "stop_token_ids", "seed"]

anything = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.lists(st.integers(-5, 60000), max_size=3), st.dictionaries(st.text(max_size=2),
                                                                                        st.integers(), max_size=2),
    st.tuples(st.integers()),
)
plausible = {
    "temperature": st.one_of(st.floats(0, 3), st.just(0.0), st.just(1e-300)),
    "top_k": st.one_of(st.just(-1), st.integers(1, 100)),
    "top_p": st.floats(1e-6, 1.0),
    "max_tokens": st.integers(1, 3),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 49151), max_size=3)),
    "seed": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
}

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def reference(llm):
    """A valid greedy request's tokens, and a check that the engine still gives exactly them."""
    prompt, params = "The capital of France is", SamplingParams(temperature=0, max_tokens=4)
    [expected] = llm.generate([prompt], params, use_tqdm=False)

    def still_sound() -> None:
        engine = llm.engine
        assert not engine.has_unfinished()
        assert engine.allocator.num_free_blocks() == engine.allocator.num_blocks
        [out] = llm.generate([prompt], params, use_tqdm=False)
        assert out.token_ids == expected.token_ids

    return still_sound


def _run_or_value_error(llm, prompts, params, **kwargs) -> str | None:
    """Generate; a ValueError's message is returned (any other exception fails the test)."""
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
    except ValueError as exc:
        return str(exc)
    for out in outputs:
        assert out.finish_reason in ("stop", "length")
    return None


@given(data=st.data())
@settings(max_examples=300, deadline=None)
def test_sampling_params_accept_or_name_the_field(data):
    fields = {name: data.draw(plausible[name]) for name in FIELDS}
    bad = data.draw(st.sampled_from(FIELDS + [None]))
    if bad is not None:
        fields[bad] = data.draw(anything)
    try:
        params = SamplingParams(**fields)
    except ValueError as exc:
        assert bad is not None and str(exc).startswith(bad), (bad, fields[bad], exc)
        return
    params.validate()
    assert isinstance(params.ignore_eos, bool) and math.isfinite(params.temperature)


@given(data=st.data())
@FUZZ
def test_fuzzed_sampling_params_run_or_are_refused_and_the_engine_stays_sound(llm, reference, data):
    fields = {name: data.draw(plausible[name]) for name in FIELDS}
    try:
        params = SamplingParams(**fields)
    except ValueError:
        params = SamplingParams(max_tokens=2)
    bad = data.draw(st.sampled_from(FIELDS + [None]))
    if bad is not None:
        setattr(params, bad, data.draw(anything))  # mutated after construction: generate validates again
    message = _run_or_value_error(llm, ["Hello", "One, two,"], params)
    if message is not None:
        assert bad is not None and bad in message, message
    reference()


token_item = st.one_of(st.integers(-10, 49160), st.integers(-2**40, 2**40), st.floats(), st.booleans(), st.none(),
                       st.text(max_size=2))
prompt = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=200),
    st.lists(st.integers(0, 49151), min_size=1, max_size=20),
    st.lists(token_item, max_size=8),
    st.builds(lambda n: "word " * n, st.integers(500, 3000)),  # over max_model_len
    st.none(), st.integers(), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


@given(prompts=st.one_of(prompt, st.lists(prompt, min_size=1, max_size=3)), max_tokens=st.integers(1, 3))
@FUZZ
def test_fuzzed_prompts_run_or_are_refused_and_the_engine_stays_sound(llm, reference, prompts, max_tokens):
    message = _run_or_value_error(llm, prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    if message is not None:
        assert "prompt" in message, message
    reference()


@given(n=st.integers(1, 3), params_len=st.integers(0, 4), priorities=st.one_of(
    st.none(), st.lists(st.one_of(st.integers(-5, 5), st.text(max_size=2), st.floats(), st.none(),
                                  st.booleans()), max_size=4), st.integers(), st.text(max_size=3)))
@FUZZ
def test_per_prompt_lists_of_the_wrong_length_or_type_name_the_field(llm, reference, n, params_len, priorities):
    prompts = ["Hi", "The sky is", "1, 2,"][:n]
    params = [SamplingParams(temperature=0, max_tokens=2)] * params_len
    message = _run_or_value_error(llm, prompts, params, priorities=priorities)
    wrong_params = params_len != n
    wrong_priorities = priorities is not None and (
        not isinstance(priorities, list) or len(priorities) != n
        or any(not isinstance(p, int) or isinstance(p, bool) for p in priorities))
    if wrong_params or wrong_priorities:
        assert message is not None and ("sampling_params" in message or "priorit" in message), message
    else:
        assert message is None
    reference()
