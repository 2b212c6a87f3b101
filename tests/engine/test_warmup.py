"""The engine's warm-up (``engine/warmup.py``): it leaves no trace in the engine's state, and the first steps of
a run are no slower than the same steps run again later (the run's own steady state is the yardstick, not a
wall-clock constant)."""

from __future__ import annotations

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.warmup import ladder, warmup_batches


def test_the_shapes_cover_prefill_chunks_and_decode_batches_within_the_cache():
    batches = warmup_batches(max_num_seqs=128, max_num_batched_tokens=2048, max_model_len=1024, num_blocks=1024,
                             block_size=16)
    prefills = [b[0][1] for b in batches if b[0][0] == 0]
    decodes = [len(b) for b in batches if b[0][1] == 1]
    assert prefills == [16, 64, 256] and decodes == ladder(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    # A tiny cache and token budget bound every shape.
    for batch in warmup_batches(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, num_blocks=3,
                                block_size=4):
        blocks = sum(-(-(context + new) // 4) for context, new in batch)
        assert blocks <= 3 and sum(new for _, new in batch) <= 32


def _sampled(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=1.0, max_tokens=6)  # the engine's own sampling stream (no seed)
    prompts = ["The quick brown fox", "Once upon a time", "def main():", "1, 2, 3,"]
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_warm_up_leaves_the_sampling_stream_and_the_cache_untouched(llm):
    # block_size=8: shapes no other engine of the session has warmed on these weights
    warm = LLM(num_kv_blocks=64, max_model_len=512, block_size=8, warmup=True)
    cold = LLM(num_kv_blocks=64, max_model_len=512, block_size=8, warmup=False)
    assert warm.engine.warmup_steps > 0 and warm.engine.warmup_time > 0
    assert cold.engine.warmup_steps == 0 and cold.engine.warmup_time == 0
    assert warm.engine.allocator.num_free_blocks() == warm.engine.num_kv_blocks and warm.engine.num_steps == 0
    assert _sampled(warm) == _sampled(cold)


def test_a_second_engine_over_the_same_weights_finds_its_shapes_warm(llm):
    """Shapes warmed once per process: an identical second engine runs none, one with more sequences runs only
    batches it adds (block_size=3: shapes no other test of the session uses)."""
    first = LLM(num_kv_blocks=96, max_model_len=512, block_size=3)
    again = LLM(num_kv_blocks=96, max_model_len=512, block_size=3)
    more_seqs = LLM(num_kv_blocks=256, max_model_len=512, block_size=3, max_num_seqs=256)
    assert first.engine.warmup_steps > 0 and again.engine.warmup_steps == 0
    # only the decode batches it adds: 128, and 256 (the largest, which also warms random sampling)
    assert more_seqs.engine.warmup_steps == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_first_steps_of_a_run_are_no_slower_than_the_same_steps_later(dtype):
    """The run right after the engine is built against three identical runs after it: the same batches, step
    for step. Cold-start costs (10-30x on the first steps, measured before the warm-up existed) would show;
    a 2x margin plus 10 ms absorbs a shared machine's noise."""
    llm = LLM(dtype=dtype, num_kv_blocks=64, max_num_seqs=4, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(100, 100 + n)) for n in (37, 20, 9)]

    def run() -> list[float]:
        llm.generate(prompts, params, use_tqdm=False)
        return [s["duration"] for s in llm.last_steps]

    first = run()
    later = [run() for _ in range(3)]
    assert all(len(r) == len(first) for r in later)
    for i in range(4):
        steady = max(r[i] for r in later)
        assert first[i] <= 2 * steady + 0.010, (i, first[:4], [r[:4] for r in later])
