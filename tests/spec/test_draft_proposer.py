"""The model proposers (``draft``, ``layer_skip``) themselves: the draft's own KV cache rolls back exactly
(proposals after any history equal a fresh draft's), it never recomputes a request's context, a draft with the
target's own weights is accepted (almost) always, self-speculation leaves the target untouched, and bad options
fail before any model loads. Greedy exactness under block sizes, chunked prefill and preemption is in
``test_spec_engine.py``."""

from __future__ import annotations

import random

import pytest

from helpers import expected_fed_tokens
from nanovllm import LLM, DraftModel, SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.proposer import check_speculative
from nanovllm.request import Request

pytestmark = pytest.mark.slow

BASE = dict(dtype="float32", attention="torch", max_model_len=1024, warmup=False)


@pytest.fixture(scope="module")
def gguf_draft_factory():
    """Builds a fresh draft over the default model's 4-bit GGUF (loaded once: the loader shares it)."""
    from transformers import AutoConfig

    from nanovllm.models.loader import resolve_model

    target_config = AutoConfig.from_pretrained(resolve_model(None, weights=False))
    return lambda: DraftModel.load(None, "gguf", target_config, "float32", "cpu")


def _request(request_id: str, tokens: list[int]) -> Request:
    request = Request(request_id, tokens[:1], SamplingParams(max_tokens=512), arrival_time=0.0)
    for token in tokens[1:]:
        request.append_token(token, 0.0)
    return request


def test_the_drafts_cache_rolls_back_exactly_whatever_the_target_accepted(gguf_draft_factory):
    kept = gguf_draft_factory()
    rng = random.Random(0)
    contexts = {"a": [1, 504, 3060, 28, 253, 2365, 6354], "b": [1, 2683, 2115, 253, 1060, 30, 2030, 314, 1000]}
    for step in range(8):
        requests = [_request(rid, tokens) for rid, tokens in contexts.items()]
        proposals = kept.propose(requests, [3, 2])
        fresh = gguf_draft_factory().propose(requests, [3, 2])
        assert proposals == fresh, f"step {step}: a stale cache entry changed the proposals"
        assert [len(p) for p in proposals] == [3, 2]
        # The target accepts a random prefix of each proposal and adds a token of its own (sometimes one the
        # draft did not propose, sometimes a whole new turn of several tokens).
        for (rid, tokens), proposal in zip(contexts.items(), proposals):
            accepted = proposal[:rng.randint(0, len(proposal))]
            tokens.extend(accepted + [rng.randrange(100, 20000) for _ in range(rng.choice([1, 1, 4]))])
    # A request's cache holds exactly the tokens fed: its context less the newest token, plus the proposals fed.
    assert set(kept.requests) == {"a", "b"}
    for request in [_request(rid, tokens) for rid, tokens in contexts.items()]:
        kept.forget(request)
    assert not kept.requests and len(kept.free) == kept.cache.shape[2]


def test_a_draft_with_the_targets_own_weights_is_accepted_and_never_recomputes_the_context():
    # No model and quantization=None: the default model's dense weights, the target's own (the loader shares them).
    llm = LLM(**BASE, speculative=dict(method="draft", num_speculative_tokens=3, quantization=None))
    assert llm.engine.speculator.proposer.draft.model is llm.engine.runner.model
    prompts = ["The quick brown fox", "In 1905, Albert Einstein published four papers that"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    drafted = sum(o.metrics.spec_decode_num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.spec_decode_num_accepted_tokens for o in outputs)
    assert drafted > 0 and accepted >= 0.9 * drafted
    draft = llm.engine.speculator.proposer.draft
    # Each position of each request is fed once, plus the proposals the target rejected (fed, then rolled back):
    # the context is never fed again.
    tokens = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outputs)
    assert draft.num_fed_tokens <= tokens + (drafted - accepted)
    assert draft.num_forwards < sum(len(o.token_ids) for o in outputs) * 3


def test_the_step_records_count_what_the_draft_model_was_fed():
    # The target's own weights draft (accepted almost always), so most steps feed the target's token and the
    # last proposal; the first proposing step feeds the whole prompt.
    llm = LLM(**BASE, speculative=dict(method="draft", num_speculative_tokens=3, quantization=None))
    prompt = "In 1905, Albert Einstein published four papers that"
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                          use_tqdm=False)[0]
    steps = llm.last_steps
    fed = [s["spec_proposer_fed_tokens"] for s in steps]
    assert fed == expected_fed_tokens(len(output.prompt_token_ids), steps)
    assert fed[1] == len(output.prompt_token_ids) + 1 + 2   # the prompt and the first token, then 2 proposals
    assert sum(fed) == llm.engine.speculator.proposer.draft.num_fed_tokens
    # ngram runs no model: its records carry no such count.
    ngram = LLM(**BASE, speculative=dict(method="ngram", num_speculative_tokens=3))
    ngram.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert all("spec_proposer_fed_tokens" not in s for s in ngram.last_steps)


def test_layer_skip_runs_the_targets_first_layers_and_leaves_the_target_whole():
    llm = LLM(**BASE, speculative=dict(method="layer_skip", num_speculative_tokens=2, num_layers=6))
    engine = llm.engine
    target = engine.runner.model
    draft = engine.speculator.proposer.draft
    assert len(target.layers) == engine.hf_config.num_hidden_layers and len(draft.model.layers) == 6
    assert all(a is b for a, b in zip(draft.model.layers, target.layers))       # shared, not copied
    assert draft.model.lm_head is target.lm_head and draft.model.norm is target.norm
    assert draft.cache.shape[0] == 6                                            # a KV cache of those layers only
    llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert draft.num_forwards > 0 and len(target.layers) == engine.hf_config.num_hidden_layers


@pytest.mark.parametrize("spec, message", [
    (dict(method="layer_skip", num_layers=0), "num_layers must be null or an integer >= 1"),
    (dict(method="draft", model="/nonexistent/model"), "expected a local HF directory"),
    (dict(method="draft", quantization="fp4"), "quantization must be"),
])
def test_bad_model_proposer_options_fail_before_any_model_loads(spec, message):
    with pytest.raises(ValueError, match=message):
        check_speculative(EngineConfig(speculative=dict(num_speculative_tokens=2, **spec)))
