"""Contracts every registered plugin must keep, parametrized over the registries: a new policy, allocator or
attention backend is tested here for free. Each plugin serves the same prompts (mixed priorities and clients, a
tight cache that preempts) in float32, and its greedy tokens must equal transformers' (``hf_greedy``, one
prompt at a time): the order of work changes, the tokens do not. The reference is independent of the engine,
so a bug in shared engine code (the scheduler, the runner, sampling) cannot hide by changing both sides. No
request is lost or duplicated, each ends the way the reference did, every block comes back."""

from __future__ import annotations

import pytest
import torch

from nanovllm import ALLOCATORS, ATTENTION_BACKENDS, LLM, POLICIES, SamplingParams

MAX_TOKENS = 10
# Short and long prompts (1 to 43 tokens: up to six 8-token blocks), in an order that is neither shortest- nor
# priority-first. Not the 227-261-token chats: each prefill (and its recompute after a preemption) of one of those
# costs as much as a dozen decode steps, and a cache sized to them preempts no more often.
PROMPT_ORDER = (12, 3, 15, 16, 0, 9, 14, 1, 11, 8)  # 8 (a short answer) ends on EOS within MAX_TOKENS
# Five requests at a time in 16 blocks (128 slots, ~50 tokens a request): several preemptions under every policy.
ENGINE = dict(max_num_seqs=5, num_kv_blocks=16, block_size=8, max_model_len=1024)


@pytest.fixture(scope="module")
def prompts(parity_prompts):
    return [parity_prompts[i] for i in PROMPT_ORDER]


@pytest.fixture(scope="module")
def expected(hf_greedy, llm):
    """request_id -> (transformers' greedy tokens, the finish reason they imply). A greedy run of
    ``MAX_TOKENS`` is the first ``MAX_TOKENS`` tokens of the longer reference run."""
    eos = llm.engine.hf_config.eos_token_id
    out = {}
    for i, index in enumerate(PROMPT_ORDER):
        tokens = hf_greedy[index][:MAX_TOKENS]
        out[f"req{i}"] = (tokens, "stop" if tokens[-1] == eos else "length")
    return out


def _serve(prompts, **options):
    """Submit every prompt (mixed priorities and clients) to a tight engine and run it dry."""
    llm = LLM(**ENGINE, **options)
    engine = llm.engine
    requests = [
        engine.make_request(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), priority=i % 3,
                            client_id=f"client{i % 2}", request_id=f"req{i}")
        for i, p in enumerate(prompts)
    ]
    for r in requests:
        engine.add_request(r)
    finished = []
    while engine.has_unfinished():
        finished.extend(engine.step().finished)
    return engine, requests, finished


def _check(engine, requests, finished, expected):
    assert sorted(r.request_id for r in finished) == sorted(expected), "a request was lost or finished twice"
    assert {r.request_id: (r.output_token_ids, r.finish_reason) for r in requests} == expected
    assert engine.allocator.num_free_blocks() == engine.allocator.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_the_prompts_exercise_both_endings_and_preemption(prompts, expected):
    # Without both finish reasons and some preemption, the contracts below would not test them.
    assert {reason for _, reason in expected.values()} == {"stop", "length"}
    engine = LLM(**ENGINE).engine
    for i, p in enumerate(prompts):
        engine.add_request(engine.make_request(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                               request_id=f"req{i}"))
    preemptions = 0
    while engine.has_unfinished():
        preemptions += engine.step().record["num_preempted"]
    assert preemptions > 0


@pytest.mark.parametrize("policy", POLICIES.names())
def test_policy_contract(policy, prompts, expected):
    _check(*_serve(prompts, scheduler=policy), expected)


@pytest.mark.parametrize("allocator", ALLOCATORS.names())
def test_allocator_contract(allocator, prompts, expected):
    _check(*_serve(prompts, allocator=allocator), expected)


@pytest.mark.parametrize("attention", ATTENTION_BACKENDS.names())
def test_attention_backend_contract(attention, prompts, expected):
    backend = ATTENTION_BACKENDS.get(attention)
    if not backend.is_available(torch.device("cpu")):
        pytest.skip(f"attention backend {attention!r} needs CUDA")
    _check(*_serve(prompts, attention=attention), expected)


def test_priority_requests_get_their_first_token_in_fewer_steps(llm):
    """More requests than max_num_seqs: the high-priority half (submitted last) starts first. Counted in engine
    steps, not wall time."""
    prompt = llm.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    engine = LLM(scheduler="priority", max_num_seqs=2, num_kv_blocks=128, max_model_len=512).engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    low = [engine.make_request(prompt, params, priority=1, request_id=f"low{i}") for i in range(4)]
    high = [engine.make_request(prompt, params, priority=0, request_id=f"high{i}") for i in range(4)]
    for r in low + high:
        engine.add_request(r)
    first_token_step = {}
    step = 0
    while engine.has_unfinished():
        engine.step()
        for r in low + high:
            if r.num_output_tokens and r.request_id not in first_token_step:
                first_token_step[r.request_id] = step
        step += 1
    high_steps = [first_token_step[r.request_id] for r in high]
    low_steps = [first_token_step[r.request_id] for r in low]
    assert max(high_steps) < min(low_steps), (high_steps, low_steps)
