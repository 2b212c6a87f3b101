"""CUDA-graph decode bucket logic on CPU: which sizes are captured and in what order, which size a batch pads
to, what padding rows do, and that the engine serves the same tokens through replayed graphs as eagerly.
CUDA is absent here, so ``torch.cuda.CUDAGraph`` is replaced by a test double that records the captured work
and re-runs it on replay; everything else (model, torch attention backend, scheduler, sampler) is real. The
real graphs are checked on a GPU by tests/kernels/test_gpu.py (graphs on vs off)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.attention.base import AttentionMetadata
from nanovllm.attention.flashinfer_plan import plan_arguments
from nanovllm.config import EngineConfig
from nanovllm.engine.cuda_graphs import (
    MAX_CAPTURED_BATCH, GraphSettings, capture_sizes, pad_decode_metadata, padded_size,
)


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph only: capture keeps the callable, replay calls it again (reading the
    static buffers, as a replayed graph does). Every graph made is logged with the pool it was given."""

    made: list["FakeGraph"] = []

    def __init__(self, pool) -> None:
        self.given_pool = pool
        self.fn = None
        FakeGraph.made.append(self)

    def capture(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()

    def pool(self):
        return ("pool of", id(self))


def test_capture_sizes_are_a_ladder_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(128) == [1, 2, 4, 8] + list(range(16, 129, 8))
    assert capture_sizes(10_000)[-1] == MAX_CAPTURED_BATCH


@pytest.mark.parametrize("max_num_seqs", [1, 5, 12, 64, 100])
def test_a_batch_pads_to_the_smallest_captured_size_that_holds_it(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    for n in range(1, max_num_seqs + 1):
        size = padded_size(n, sizes)
        assert size in sizes and size >= n
        assert all(s < n for s in sizes if s < size)
    assert padded_size(sizes[-1] + 1, sizes) is None


def test_padding_rows_write_and_read_only_the_scratch_block():
    meta = AttentionMetadata(query_lens=[1, 1, 1], seq_lens=[5, 17, 1], block_tables=[[3], [0, 6], [2]],
                             slot_mapping=torch.tensor([52, 96, 32]), block_size=16)
    padded = pad_decode_metadata(meta, 8, scratch_block=9)
    assert padded.query_lens == [1] * 8 and padded.seq_lens == [5, 17, 1] + [1] * 5
    assert padded.block_tables == [[3], [0, 6], [2]] + [[9]] * 5
    assert padded.slot_mapping.tolist() == [52, 96, 32] + [9 * 16] * 5
    plan = plan_arguments(padded)
    assert plan.kv_indices.tolist()[-5:] == [9] * 5 and plan.kv_last_page_len.tolist()[-5:] == [1] * 5


def test_enforce_eager_is_validated():
    with pytest.raises(ValueError, match="enforce_eager must be true or false"):
        EngineConfig(enforce_eager="yes")
    assert EngineConfig(enforce_eager=True).enforce_eager


def _serve(engine, prompts, max_tokens):
    requests = [engine.make_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
                for p, m in zip(prompts, max_tokens)]
    for r in requests:
        engine.add_request(r)
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step().record)
    return [r.output_token_ids for r in requests], steps


def test_engine_replays_padded_graphs_and_serves_the_eager_tokens(llm, parity_prompts):
    """7 requests finishing one after another, so decode batches shrink through every size 7..1; with
    max_num_seqs=10 the ladder is 1, 2, 4, 8, 10."""
    prompts = [p for p in sorted(parity_prompts, key=len) if len(p) > 1][:7]
    max_tokens = [2 + i for i in range(len(prompts))]
    options = dict(max_num_seqs=10, num_kv_blocks=256, max_model_len=1024)
    eager = LLM(**options).engine
    expected, _ = _serve(eager, prompts, max_tokens)
    assert eager.runner.decode_graphs is None  # CPU: no graphs unless asked for

    graphed = LLM(**options).engine
    FakeGraph.made = []
    graphed.runner.init_kv_cache(graphed.num_kv_blocks, graphed.config.block_size, graphed.runner.backend,
                                 GraphSettings(10, graphed.max_model_len, graph_factory=FakeGraph))
    graphs = graphed.runner.decode_graphs
    assert graphs.sizes == [1, 2, 4, 8, 10]
    assert graphed.runner.kv_cache.shape[2] == graphed.num_kv_blocks + 1  # the scratch block
    assert graphs.scratch_block == graphed.num_kv_blocks
    # Largest first; the first graph's pool is shared by the others.
    assert [graphs.graphs[s] for s in reversed(graphs.sizes)] == FakeGraph.made
    assert FakeGraph.made[0].given_pool is None
    assert all(g.given_pool == FakeGraph.made[0].pool() for g in FakeGraph.made[1:])
    graphs.replays = {s: 0 for s in graphs.sizes}

    tokens, steps = _serve(graphed, prompts, max_tokens)
    assert tokens == expected
    decode_steps = [s["num_decode_seqs"] for s in steps if s["num_prefill_seqs"] == 0]
    assert Counter(padded_size(n, graphs.sizes) for n in decode_steps) == +Counter(graphs.replays)
    assert all(graphs.replays[s] > 0 for s in (1, 2, 4, 8))
    assert graphed.allocator.num_free_blocks() == graphed.num_kv_blocks


def test_graph_output_has_only_the_real_rows(llm):
    """A batch of 3 replays the size-4 graph; 3 rows come back and they equal an eager forward."""
    engine = LLM(max_num_seqs=4, num_kv_blocks=64, max_model_len=256).engine
    runner = engine.runner
    runner.init_kv_cache(engine.num_kv_blocks, 16, runner.backend, GraphSettings(4, 256, graph_factory=FakeGraph))
    ids, positions = torch.tensor([11, 12, 13]), torch.tensor([0, 0, 0])
    meta = AttentionMetadata(query_lens=[1, 1, 1], seq_lens=[1, 1, 1], block_tables=[[0], [1], [2]],
                             slot_mapping=torch.tensor([0, 16, 32]), block_size=16)
    with torch.inference_mode():
        hidden = runner.decode_graphs.run(ids, positions, meta).clone()
        runner.backend.plan(meta)
        eager = runner.model(ids, positions, runner.backend)
    assert runner.decode_graphs.replays[4] == 1 and hidden.shape[0] == 3
    # A 4-row GEMM may round differently from a 3-row one in the last bits, hence the tolerance.
    torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-3)
