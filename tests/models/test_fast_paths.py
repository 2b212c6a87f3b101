"""Every fast path (bfloat16, fused projections, the cpu attention kernel) meets vLLM's closeness standard
against transformers in the same dtype, on the parity prompts in one ``generate`` call, also under repeated
preemption and chunked prefill: greedy tokens agree up to the first divergence, and there each side's token is
in the other's top-5 logprobs. (The float32 reference path is held to the exact standard in test_parity.py.)"""

from __future__ import annotations

import pytest

from nanovllm.validate import CLOSE, EXACT, agreement_sign_test, validate_output
from tests.conftest import PARITY_MAX_TOKENS


def _preempting(prompts) -> dict:
    """A cache that holds the longest request and little more, so requests are preempted again and again."""
    block_size = 4
    return dict(block_size=block_size, num_kv_blocks=-(-(max(map(len, prompts)) + PARITY_MAX_TOKENS) // block_size) + 2)


FAST_PATHS = {
    "bf16": dict(dtype="bfloat16"),
    "bf16-preemption": dict(dtype="bfloat16", preempt=True),
    "bf16-chunked-prefill": dict(dtype="bfloat16", max_num_batched_tokens=32),
    "bf16-torch-attention-unfused": dict(dtype="bfloat16", attention="torch", fuse_projections=False),
    "fp32-fused-cpu-attention": dict(dtype="float32", fuse_projections=True),
}


@pytest.mark.parametrize("path", sorted(FAST_PATHS))
def test_fast_path_meets_the_close_standard(path, parity_prompts, hf_references):
    options = dict(FAST_PATHS[path])
    order = list(range(len(parity_prompts)))
    if options.pop("preempt", False):
        options.update(_preempting(parity_prompts))
        # Shortest first, as in test_parity: many requests are admitted together, then their growth preempts.
        order.sort(key=lambda i: len(parity_prompts[i]))
    options.setdefault("num_kv_blocks", 1024)
    refs = hf_references(options["dtype"])
    report = validate_output(prompts=[parity_prompts[i] for i in order], max_tokens=PARITY_MAX_TOKENS,
                             max_model_len=1024, references=[refs[i] for i in order], **options)
    assert report.standard == CLOSE
    failing = [(i, r.matching_prefix, r.ours, r.reference) for i, r in enumerate(report.results) if not r.close]
    assert not failing, failing
    # Real agreement, not vacuous closeness: ours stays with the exact float32 model as long as transformers'
    # own tokens in this dtype do, unless a sign test over the prompts says it is shorter (validate.py).
    exact = [hf_references("float32")[i][0] for i in order]
    sign = agreement_sign_test([r.ours for r in report.results], [refs[i][0] for i in order], exact)
    assert sign.passed, sign
    if "preempt" in FAST_PATHS[path]:
        assert report.num_preemptions >= 5
    if "max_num_batched_tokens" in options:
        assert report.max_step_tokens <= options["max_num_batched_tokens"]


def test_reference_path_is_held_to_the_exact_standard(parity_prompts, hf_references):
    report = validate_output(prompts=parity_prompts[:4], max_tokens=PARITY_MAX_TOKENS, attention="torch",
                             num_kv_blocks=256, max_model_len=1024,
                             references=hf_references("float32")[:4])
    assert report.standard == EXACT and report.passed


def test_the_sign_test_rejects_a_path_that_diverges_early_on_most_prompts():
    exact = [[1, 2, 3, 4, 5, 6]] * 10
    peer = [[1, 2, 3, 4, 5, 6]] * 6 + [[1, 2, 3, 9, 9, 9]] * 4
    early = [[1, 7, 7, 7, 7, 7]] * 10                            # diverges at token 2 on every prompt
    mixed = [[1, 2, 3, 4, 5, 6]] * 5 + [[1, 2, 7, 7, 7, 7]] * 3 + [[1, 2, 3, 4, 5, 6]] * 2
    assert not agreement_sign_test(early, peer, exact).passed
    result = agreement_sign_test(mixed, peer, exact)
    assert result.passed and (result.longer, result.shorter, result.ties) == (2, 3, 5)
    assert agreement_sign_test(peer, peer, exact).p_value == 1.0


def test_close_standard_fails_when_a_token_is_outside_the_other_top5():
    from nanovllm.validate import PromptAgreement

    near = PromptAgreement("p", [1, 2, 3], [1, 2, 4], [{1}, {2}, {3, 4}], [{1}, {2}, {4, 3}])
    far = PromptAgreement("p", [1, 2, 3], [1, 2, 4], [{1}, {2}, {3, 5}], [{1}, {2}, {4, 3}])
    assert near.close and not near.identical
    assert not far.close
