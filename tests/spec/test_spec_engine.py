"""Speculative decoding on the real model, float32 with the torch reference attention: greedy output with
speculation (``ngram``, ``draft``: the default model's 4-bit GGUF, ``layer_skip``: the target's first layers) is
identical to decoding without it, whatever the block size, chunking, cache pressure (preemption), allocator,
stop condition or abort, while proposals really are accepted."""

from __future__ import annotations

import functools

import pytest

from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

NGRAM = dict(method="ngram", num_speculative_tokens=3)
PROPOSERS = {
    "ngram": NGRAM,
    "draft": dict(method="draft", num_speculative_tokens=3),         # the default model's own 4-bit GGUF drafts
    "layer_skip": dict(method="layer_skip", num_speculative_tokens=3),
}
BASE = dict(dtype="float32", attention="torch", max_model_len=1024, warmup=False)
LIST = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango"
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
PROMPTS = [
    f"Repeat this list exactly: {LIST}. Again: {LIST}. Again:",              # output copies the prompt
    "Copy the following code exactly.\n\n" + CODE + "\nCopy:\n\ndef add",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4,",
    "The quick brown fox",                                                    # little to look up
    "In 1905, Albert Einstein published four papers that",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker",
]
# 24 tokens: past the prompts' block boundaries and through several accepted runs each; the copying prompts are
# still copying when it ends (so the acceptance floors below hold). Each step of the layer_skip proposer costs
# three draft passes plus the verification, so the length of the outputs is most of this module's time.
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
# Plain greedy decoding does not depend on the block size, chunking, cache pressure or allocator (the parity
# modules under tests/models/ hold each of those to transformers' tokens), so one plain run is the standard every
# configuration's speculative run is held to: ``_plain`` generates it once for the module, in this configuration.
PLAIN_OPTIONS = dict(num_kv_blocks=256)


@functools.cache
def _llm(speculative: bool | str, **options) -> LLM:
    """One engine per configuration for the module (the loader shares the weights between them, the GGUF draft's
    too). ``speculative``: False (off), True (``ngram``) or a proposer's name."""
    method = "ngram" if speculative is True else speculative
    return LLM(**BASE, **options, speculative=PROPOSERS[method] if method else None)


def _generate(speculative: bool | str, prompts=PROMPTS, params=GREEDY, **options):
    return _llm(speculative, **options).generate(prompts, params, use_tqdm=False)


@functools.cache
def _plain(prompts: tuple[str, ...]) -> list:
    """Greedy output of ``prompts`` without speculation (in ``PLAIN_OPTIONS``): the standard every proposer's run
    in every configuration is held to, generated once for the module rather than once per proposer and
    configuration."""
    return _llm(False, **PLAIN_OPTIONS).generate(list(prompts), GREEDY, use_tqdm=False)


def _assert_identical_and_accepted(options: dict, prompts=PROMPTS, method: str = "ngram") -> list:
    plain = _plain(tuple(prompts))
    spec_llm = _llm(method, **options)
    spec = spec_llm.generate(prompts, GREEDY, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason, b.prompt
    accepted = sum(o.metrics.spec_decode_num_accepted_tokens for o in spec)
    drafted = sum(o.metrics.spec_decode_num_draft_tokens for o in spec)
    assert 0 < accepted <= drafted
    # The step records count what the requests count.
    steps = spec_llm.last_steps
    assert sum(s["spec_decode_num_accepted_tokens"] for s in steps) == accepted
    assert sum(s["spec_decode_num_draft_tokens"] for s in steps) == drafted
    assert sum(s["spec_decode_num_drafts"] for s in steps) == sum(o.metrics.spec_decode_num_drafts for o in spec)
    assert all(s["num_prefill_tokens"] + s["num_decode_tokens"] <= spec_llm.engine.config.max_num_batched_tokens
               for s in steps)
    draft = getattr(spec_llm.engine.speculator.proposer, "draft", None)
    if draft is not None:
        # Every request ended: the draft model's cache holds nothing and all its blocks are free again.
        assert not draft.requests and len(draft.free) == draft.cache.shape[2]
    return spec


@pytest.mark.parametrize("method", list(PROPOSERS))
@pytest.mark.parametrize("block_size", [16, 256])
def test_greedy_output_is_identical_with_speculation_at_every_block_size(block_size, method):
    options = dict(block_size=block_size, num_kv_blocks=4096 // block_size)
    spec = _assert_identical_and_accepted(options, method=method)
    copying = spec[0].metrics
    if method != "layer_skip":   # SmolLM2's early layers were not trained to exit early: they agree less often
        assert copying.spec_decode_num_accepted_tokens >= 0.5 * copying.spec_decode_num_draft_tokens
    # Alone, the copying prompt takes fewer steps than it has tokens: each accepted proposal saved one.
    llm = _llm(method, **options)
    alone = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    decode_steps = [s for s in llm.last_steps if s["num_decode_seqs"]]
    assert len(decode_steps) == len(alone.token_ids) - 1 - alone.metrics.spec_decode_num_accepted_tokens


@pytest.mark.parametrize("method", list(PROPOSERS))
def test_identical_under_chunked_prefill_with_proposals_squeezed_by_the_token_budget(method):
    # 24 tokens a step: prompts arrive in chunks beside decodes, and proposals get what the decodes leave.
    _assert_identical_and_accepted(dict(max_num_batched_tokens=24, num_kv_blocks=256), method=method)


@pytest.mark.parametrize("method", list(PROPOSERS))
def test_identical_when_a_small_cache_preempts_requests_and_no_accepted_token_is_lost(method):
    options = dict(num_kv_blocks=16, max_num_seqs=6)    # 256 slots for six requests of up to 83 tokens
    spec = _assert_identical_and_accepted(options, method=method)
    assert sum(o.metrics.num_preemptions for o in spec) > 0


def test_identical_with_the_prefix_cache_on_shared_prefixes():
    prompts = [PROMPTS[0], PROMPTS[0] + " apple,", PROMPTS[0] + " apple, banana"]
    _assert_identical_and_accepted(dict(num_kv_blocks=256, allocator="prefix"), prompts)


def test_stop_tokens_and_max_tokens_inside_accepted_runs_end_the_output_where_plain_decoding_does():
    base = _plain(tuple(PROMPTS))[0].token_ids
    stop = base[12]            # a token of the copied list, deep inside accepted runs
    # Where plain greedy decoding ends: at the stop token's first occurrence (kept), or after max_tokens.
    ends = {base.index(stop) + 1: SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop])}
    ends.update({n: SamplingParams(temperature=0.0, max_tokens=n) for n in (2, 5, 9, 14)})
    for end, params in ends.items():
        [spec] = _generate(True, [PROMPTS[0]], params, num_kv_blocks=256)
        assert spec.token_ids == base[:end], params
        assert spec.finish_reason == ("stop" if params.stop_token_ids else "length")


def test_logprobs_of_emitted_tokens_match_plain_decoding():
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3)
    plain, spec = (_generate(s, PROMPTS[:2], params, num_kv_blocks=256) for s in (False, True))
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids and len(b.logprobs) == len(a.logprobs) == len(a.token_ids)
        for la, lb in zip(a.logprobs, b.logprobs):
            assert set(la) == set(lb)
            for token in la:
                assert lb[token].logprob == pytest.approx(la[token].logprob, abs=1e-3)
                assert lb[token].rank == la[token].rank


def test_an_aborted_request_keeps_every_token_it_accepted():
    full = _plain(tuple(PROMPTS))[0].token_ids
    engine = _llm(True, num_kv_blocks=256).engine
    # Longer than the six steps below can reach (at most 1 + 5 x 4 tokens): it is still running when aborted.
    request = engine.make_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40))
    engine.add_request(request)
    for _ in range(6):
        engine.step()
    assert request.num_accepted_tokens > 0
    kept = list(request.output_token_ids)
    engine.abort_request(request.request_id)
    assert engine.step().finished == [request]
    assert request.output_token_ids == kept == full[:len(kept)]
    assert engine.allocator.num_free_blocks() == engine.num_kv_blocks


def test_seeded_sampling_with_speculation_is_reproducible():
    params = SamplingParams(temperature=0.8, max_tokens=32, seed=3)
    first, second = (_generate(True, PROMPTS[:3], params, num_kv_blocks=256) for _ in range(2))
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert sum(o.metrics.spec_decode_num_accepted_tokens for o in first) > 0
