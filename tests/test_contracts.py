"""Contracts every registered plugin must keep, parametrized over the registries: a new policy, allocator or
attention backend is tested here for free. Greedy tokens are identical to the FCFS/paged/torch baseline (the
order of work changes, the tokens do not), no request is lost or duplicated, every block comes back."""

from __future__ import annotations

import pytest
import torch

from nanovllm import ALLOCATORS, ATTENTION_BACKENDS, LLM, POLICIES, SamplingParams

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def prompts(parity_prompts):
    # Short and long prompts, in an order that is neither shortest- nor priority-first.
    return [parity_prompts[i] for i in (12, 3, 5, 16, 0, 9, 14, 6, 11, 1)]


def _serve(prompts, **options):
    """Submit every prompt (mixed priorities and clients) to a tight engine and run it dry."""
    llm = LLM(max_num_seqs=3, num_kv_blocks=40, block_size=8, max_model_len=1024, **options)
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


@pytest.fixture(scope="module")
def baseline(prompts):
    _, requests, _ = _serve(prompts)
    return {r.request_id: r.output_token_ids for r in requests}


def _check(engine, requests, finished, baseline):
    ids = [r.request_id for r in finished]
    assert sorted(ids) == sorted(baseline), "a request was lost or finished twice"
    assert all(r.finish_reason in ("stop", "length") for r in requests)
    assert {r.request_id: r.output_token_ids for r in requests} == baseline
    assert engine.allocator.num_free_blocks() == engine.allocator.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("policy", POLICIES.names())
def test_policy_contract(policy, prompts, baseline):
    _check(*_serve(prompts, scheduler=policy), baseline)


@pytest.mark.parametrize("allocator", ALLOCATORS.names())
def test_allocator_contract(allocator, prompts, baseline):
    _check(*_serve(prompts, allocator=allocator), baseline)


@pytest.mark.parametrize("attention", ATTENTION_BACKENDS.names())
def test_attention_backend_contract(attention, prompts, baseline):
    backend = ATTENTION_BACKENDS.get(attention)
    if not backend.is_available(torch.device("cpu")):
        pytest.skip(f"attention backend {attention!r} needs CUDA")
    _check(*_serve(prompts, attention=attention), baseline)


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
