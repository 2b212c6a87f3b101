"""The GPU path, on a CUDA device (mark ``gpu``; skipped only where CUDA is absent; run by
``bash experiments/gpu_check.sh``):

- FlashInfer's kernels against the torch reference backend on CUDA, on random batches (decodes, chunks on
  cached prefixes, preempted-and-resumed requests; block sizes 1, 16, 64; GQA and MHA; bf16 and fp16), and
  against the documented-semantics emulation that checks the plan arguments on CPU;
- the float32 reference path (torch backend) on CUDA is token-identical to transformers on CUDA;
- ``attention=flashinfer`` in bf16 and fp16 meets the fast-path standard against that reference: greedy tokens
  equal up to the first divergence, and there each side's token is in the other's top-5;
- CUDA graphs on vs off: identical tokens while every decode batch is a captured size (no padding), the
  fast-path standard when batches are padded (a padded GEMM may round differently);
- the KV cache takes the asked fraction of free GPU memory.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from flashinfer_emulation import batch_paged_attention
from nanovllm import LLM, SamplingParams
from nanovllm.attention.base import AttentionMetadata
from nanovllm.attention.flashinfer_plan import plan_arguments
from nanovllm.attention.torch_backend import TorchAttention
from nanovllm.engine.kv_cache import allocate_kv_cache, bytes_per_block
from paged_batches import RandomBatches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_TOKENS = 24
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2}  # a few units in the last place of the output


def _flashinfer(*args):
    from nanovllm.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(*args)


# -- kernels -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("heads", [(9, 3, 64), (16, 8, 128), (8, 8, 128)], ids=["smollm2", "qwen3", "mha"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_flashinfer_kernels_match_the_torch_backend(dtype, heads, block_size):
    num_heads, num_kv_heads, head_dim = heads
    scale = head_dim ** -0.5
    device = torch.device("cuda")
    torch.manual_seed(block_size)
    batches = RandomBatches(random.Random(block_size + num_heads), block_size, num_blocks=8 * (130 // block_size + 2))
    reference, flashinfer = TorchAttention(num_heads, num_kv_heads, head_dim, scale), _flashinfer(*heads, scale)
    for backend in (reference, flashinfer):
        _, views = allocate_kv_cache(1, len(batches.free), block_size, num_kv_heads, head_dim, dtype, device)
        backend.bind_kv_caches(views)
    tol = TOLERANCE[dtype]
    for _ in range(40):
        meta, _ = batches.next_step()
        meta.slot_mapping = meta.slot_mapping.to(device)
        n = sum(meta.query_lens)
        q = torch.randn(n, num_heads, head_dim, device=device, dtype=dtype)
        k, v = torch.randn(2, n, num_kv_heads, head_dim, device=device, dtype=dtype)
        reference.plan(meta)
        expected = reference.forward(0, q, k, v)
        flashinfer.plan(meta)
        got = flashinfer.forward(0, q, k, v)
        torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
        k_cache, v_cache = (t.cpu() for t in flashinfer.kv_caches[0])
        emulated = batch_paged_attention(q.cpu(), k_cache, v_cache, plan_arguments(meta), sm_scale=scale)
        torch.testing.assert_close(got.float().cpu(), emulated.reshape(n, -1), atol=tol, rtol=tol)
    assert all(count > 0 for count in batches.seen.values()), batches.seen


# -- engines -----------------------------------------------------------------------------------------------------

def _engine(**options) -> LLM:
    return LLM(device="cuda", num_kv_blocks=2048, max_model_len=1024, **options)


@pytest.fixture(scope="module")
def reference():
    """The float32 reference path on CUDA (torch attention backend, eager)."""
    return _engine(dtype="float32")


@pytest.fixture(scope="module")
def reference_tokens(reference, parity_prompts):
    return _greedy(reference, parity_prompts)


def _greedy(llm: LLM, prompts, max_tokens: int = MAX_TOKENS, ignore_eos: bool = True) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _top5(llm: LLM, token_ids: list[int]) -> list[int]:
    """The five likeliest next tokens after ``token_ids`` under the engine's own model, dtype and attention
    backend: one prefill into the first blocks of the (idle) engine's cache."""
    engine = llm.engine
    assert not engine.has_unfinished()
    runner = engine.runner
    n, block_size, device = len(token_ids), runner.block_size, runner.device
    meta = AttentionMetadata(query_lens=[n], seq_lens=[n], block_tables=[list(range(-(-n // block_size)))],
                             slot_mapping=torch.arange(n, device=device), block_size=block_size)
    with torch.inference_mode():
        runner.backend.plan(meta)
        hidden = runner.model(torch.tensor(token_ids, device=device), torch.arange(n, device=device),
                              runner.backend)
        logits = runner.model.compute_logits(hidden[-1:])
    return logits[0].topk(5).indices.tolist()


def _assert_fast_path_standard(ref_llm, ref_out, fast_llm, fast_out, prompts) -> int:
    """vLLM's standard for fast paths; returns how many outputs diverged somewhere."""
    diverged = 0
    for i, (prompt, ref, fast) in enumerate(zip(prompts, ref_out, fast_out)):
        assert len(ref) == len(fast), f"prompt {i}: {len(ref)} vs {len(fast)} tokens"
        at = next((j for j, (a, b) in enumerate(zip(ref, fast)) if a != b), None)
        if at is None:
            continue
        diverged += 1
        prefix = list(prompt) + ref[:at]
        assert fast[at] in _top5(ref_llm, prefix), f"prompt {i}, token {at}: fast path's choice not in reference top-5"
        assert ref[at] in _top5(fast_llm, prefix), f"prompt {i}, token {at}: reference's choice not in fast top-5"
    return diverged


def test_fp32_torch_backend_on_cuda_is_token_identical_to_transformers(reference, parity_prompts):
    from transformers import AutoModelForCausalLM

    from nanovllm.validate import reference_greedy

    hf = AutoModelForCausalLM.from_pretrained(reference.engine.model_dir, dtype=torch.float32).to("cuda").eval()
    expected = reference_greedy(hf, parity_prompts, MAX_TOKENS)
    assert _greedy(reference, parity_prompts, ignore_eos=False) == expected


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_flashinfer_meets_the_fast_path_standard(dtype, reference, reference_tokens, parity_prompts):
    fast = _engine(dtype=dtype, attention="flashinfer")
    assert fast.engine.runner.decode_graphs is not None  # graphs are on by default on CUDA
    fast_tokens = _greedy(fast, parity_prompts)
    diverged = _assert_fast_path_standard(reference, reference_tokens, fast, fast_tokens, parity_prompts)
    print(f"\nflashinfer {dtype}: {len(parity_prompts) - diverged}/{len(parity_prompts)} outputs identical "
          f"to the float32 reference over {MAX_TOKENS} tokens")


def test_cuda_graphs_on_and_off_give_identical_tokens(parity_prompts):
    """8 short prompts prefilled in one step, the same number of new tokens each: every decode batch has 8
    rows, a captured size, so graphs replay unpadded and must match eager steps token for token."""
    prompts = sorted(parity_prompts, key=len)[:8]
    on, off = (_engine(dtype="bfloat16", attention="flashinfer", max_num_seqs=8, enforce_eager=eager)
               for eager in (False, True))
    assert off.engine.runner.decode_graphs is None
    assert _greedy(on, prompts) == _greedy(off, prompts)
    replays = on.engine.runner.decode_graphs.replays
    assert replays[8] == MAX_TOKENS - 1 and sum(replays.values()) == replays[8], replays


def test_padded_graph_replays_meet_the_fast_path_standard(parity_prompts):
    """Requests finishing one by one: decode batches of 11 down to 1 pad to 12, 8, 4, 2, 1."""
    prompts = sorted(parity_prompts, key=len)[:11]
    max_tokens = [4 + 2 * i for i in range(len(prompts))]
    on, off = (_engine(dtype="bfloat16", attention="flashinfer", max_num_seqs=12, enforce_eager=eager)
               for eager in (False, True))

    def run(llm):
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    on_tokens, off_tokens = run(on), run(off)
    _assert_fast_path_standard(off, off_tokens, on, on_tokens, prompts)
    replays = on.engine.runner.decode_graphs.replays
    assert all(replays[size] > 0 for size in (1, 2, 4, 8, 12)), replays


def test_kv_cache_takes_the_asked_fraction_of_free_gpu_memory():
    gc.collect()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    # max_num_seqs only lifts the cap (max_num_seqs full-length requests) above the memory budget.
    llm = LLM(device="cuda", dtype="bfloat16", attention="flashinfer", kv_cache_fraction=0.2,
              max_num_seqs=4096, max_model_len=1024, enforce_eager=True)
    engine, runner = llm.engine, llm.engine.runner
    block = bytes_per_block(runner.num_layers, runner.num_kv_heads, runner.head_dim, engine.config.block_size,
                            torch.bfloat16)
    kv_bytes = engine.num_kv_blocks * block
    # The budget is taken after the weights load, so it is at most 20% of what was free before, and less by
    # at most 20% of the weights and the allocator's slack.
    assert 0.2 * free_before - 2 * 1024 ** 3 <= kv_bytes <= 0.2 * free_before + block
    assert runner.kv_cache.shape[2] == engine.num_kv_blocks  # eager: no scratch block for graph padding
