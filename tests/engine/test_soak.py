"""Soak: thousands of short requests through the real engine with random sampling parameters, priorities and
aborts, on a KV cache small enough that preemption is constant. Every request must end (finished, aborted or
failed, each with its reason), every block must come back, and what the engine retains must not grow with the
number of requests it has served.

The model is a small random-weight Llama (``helpers.save_tiny_model``, SmolLM2's vocabulary and tokenizer): what is
soaked is the engine's bookkeeping (scheduler, allocator, policy, sampler, abort paths), which runs exactly as
with the default model, and a step costs ~1 ms instead of ~50, so the suite can afford thousands of requests.
"""

from __future__ import annotations

import random

import pytest
import transformers
from helpers import save_tiny_model

from nanovllm import LLM, RequestStatus, SamplingParams

NUM_REQUESTS = 5000


def _retained(engine) -> dict[str, int]:
    """Items held by every container of the engine, its scheduler, allocator and policy."""
    sizes = {}
    for owner_name, owner in (("engine", engine), ("scheduler", engine.scheduler), ("allocator", engine.allocator),
                              ("policy", engine.policy)):
        for name, value in vars(owner).items():
            if isinstance(value, (list, dict, set, tuple)) or (hasattr(value, "__len__") and not hasattr(value, "shape")):
                try:
                    sizes[f"{owner_name}.{name}"] = len(value)
                except TypeError:
                    continue
    return sizes


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.0, 0.7, 1.0, 1.5]),
        top_k=rng.choice([-1, 1, 5, 50]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        max_tokens=rng.randint(1, 3),
        ignore_eos=rng.random() < 0.5,
        stop_token_ids=rng.choice([None, [rng.randrange(49152)]]),
        seed=rng.choice([None, rng.randrange(2**31)]),
    )


def _serve_soak(engine, rng: random.Random, num_requests: int, id_prefix: str) -> dict[str, object]:
    """Add requests a few per step (some invalid), abort a random in-flight one now and then, run dry."""
    vocab = engine.vocab_size
    requests, ended = {}, {}
    next_id = 0
    while next_id < num_requests or engine.has_unfinished():
        for _ in range(rng.randint(0, 16)):
            if next_id == num_requests:
                break
            request_id = f"{id_prefix}{next_id}"
            next_id += 1
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            params, priority = _random_params(rng), rng.randint(0, 3)
            if rng.random() < 0.02:
                prompt = prompt + [vocab + 5]  # out of the vocabulary: refused, and must still end
            try:
                request, error = engine.make_request(prompt, params, priority=priority, request_id=request_id), None
            except ValueError as exc:
                request, error = engine.rejected_request(prompt, params, request_id=request_id), str(exc)
            engine.add_request(request, error=error)
            requests[request_id] = request
        in_flight = [r.request_id for r in (*engine.scheduler.running, *engine.scheduler.waiting)]
        if in_flight and rng.random() < 0.15:
            assert engine.abort_request(rng.choice(in_flight), "soak abort")
        if rng.random() < 0.05:
            assert not engine.abort_request(f"{id_prefix}{rng.randrange(next_id + 1)}x")  # never existed
        for request in engine.step().finished:
            assert request.request_id not in ended, f"{request.request_id} ended twice"
            ended[request.request_id] = request
    return {"requests": requests, "ended": ended}


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, llm):
    path = tmp_path_factory.mktemp("soak-llama")
    save_tiny_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, {}, path, llm.engine.model_dir)
    return path


def test_soak_every_request_ends_no_block_leaks_and_memory_stays_bounded(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), scheduler={"name": "priority", "preempt_for_priority": True},
              allocator="prefix", num_kv_blocks=12, block_size=2, max_num_seqs=16, max_model_len=64, max_num_batched_tokens=128)
    engine = llm.engine
    rng = random.Random(14)
    warmup = _serve_soak(engine, rng, 200, "warm")
    retained_after_warmup = _retained(engine)
    run = _serve_soak(engine, rng, NUM_REQUESTS, "soak")
    requests, ended = run["requests"], run["ended"]

    assert set(ended) == set(requests) and len(warmup["ended"]) == 200
    by_status = {status: [r for r in requests.values() if r.status is status] for status in RequestStatus}
    for r in by_status[RequestStatus.FINISHED]:
        assert r.finish_reason in ("stop", "length") and 1 <= r.num_output_tokens <= r.max_tokens
    for r in by_status[RequestStatus.ABORTED]:
        assert r.finish_reason == "abort" and r.error == "soak abort"
    for r in by_status[RequestStatus.FAILED]:
        assert r.error and r.finish_reason is None
    assert len(by_status[RequestStatus.FINISHED]) + len(by_status[RequestStatus.ABORTED]) \
        + len(by_status[RequestStatus.FAILED]) == NUM_REQUESTS
    # The load was what it claims: preemption happened constantly, and so did aborts and refusals.
    assert sum(r.num_preemptions for r in requests.values()) > NUM_REQUESTS // 100
    assert len(by_status[RequestStatus.ABORTED]) > 20 and len(by_status[RequestStatus.FAILED]) > 10
    # Nothing leaked: every block is free again, nothing is queued, and no container grew with the run.
    assert engine.allocator.num_free_blocks() == engine.allocator.num_blocks
    assert not engine.has_unfinished()
    retained = _retained(engine)
    grown = {k: (retained_after_warmup.get(k), v) for k, v in retained.items()
             if v > max(2 * retained_after_warmup.get(k, 0), 64)}
    assert not grown, f"containers that grew with the number of requests served: {grown}"
