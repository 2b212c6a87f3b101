"""pytest-benchmark: nano-vllm next to transformers on the same batch, in one run (compare the two rows of the
``throughput`` group). Not collected by the normal suite (pyproject's norecursedirs); run with

    python -m pytest tests/benchmarks --benchmark-only --benchmark-group-by=group
"""

from __future__ import annotations

import pytest

from experiments.bench_vs_hf import chat_prompts, run_transformers
from nanovllm import SamplingParams

NUM_PROMPTS, MAX_TOKENS = 16, 16


@pytest.fixture(scope="module")
def prompts(llm):
    return chat_prompts(llm, NUM_PROMPTS)


@pytest.mark.benchmark(group="throughput")
def test_nanovllm_generate(benchmark, llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = benchmark.pedantic(llm.generate, args=(prompts, params), kwargs={"use_tqdm": False},
                                 rounds=3, warmup_rounds=1)
    assert sum(len(o.token_ids) for o in outputs) == NUM_PROMPTS * MAX_TOKENS


@pytest.mark.benchmark(group="throughput")
def test_transformers_static_batch(benchmark, hf_model, prompts):
    pad = hf_model.config.eos_token_id
    _, tokens = benchmark.pedantic(run_transformers, args=(hf_model, prompts, MAX_TOKENS, pad), rounds=3,
                                   warmup_rounds=1)
    assert sum(map(len, tokens)) == NUM_PROMPTS * MAX_TOKENS


@pytest.mark.benchmark(group="decode-step")
def test_nanovllm_decode_step(benchmark, llm, prompts):
    """One engine step with a full batch decoding (after every prompt was prefilled)."""
    engine = llm.engine
    for p in prompts:
        engine.add_request(engine.make_request(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)))
    engine.step()  # the prefill
    timed = []
    benchmark.pedantic(lambda: timed.append(engine.step().record), rounds=20, warmup_rounds=2)
    while engine.has_unfinished():
        engine.step()
    assert all(s["num_decode_seqs"] == NUM_PROMPTS and s["num_prefill_tokens"] == 0 for s in timed)
