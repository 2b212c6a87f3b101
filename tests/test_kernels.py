"""The fast path's fused C++ kernels against the torch code they replace (same math, float32 inside)."""

from __future__ import annotations

import pytest
import torch

from nanovllm import kernels
from nanovllm.models.llama import RMSNorm, apply_rotary


def _norm_with_random_weight(dtype: torch.dtype, dim: int = 96) -> RMSNorm:
    """The reference RMSNorm module with a random (not all-ones) weight, in ``dtype``."""
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference_module(dtype):
    torch.manual_seed(0)
    norm = _norm_with_random_weight(dtype)
    x = (torch.randn(37, 96) * 3).to(dtype)
    expected = norm(x)
    got = kernels.load().rms_norm(x, norm.weight, norm.eps)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_fused_projection_views(dtype):
    torch.manual_seed(1)
    tokens, heads, kv_heads, dim = 11, 6, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q_view, k_view, v_view = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q_view.reshape(tokens, heads, dim), k_view.reshape(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    expected_q, expected_k = apply_rotary((cos[:, None].to(dtype), sin[:, None].to(dtype)), q.clone(), k.clone())
    v_before = v_view.clone()
    kernels.load().rotary_(q, k, cos.contiguous(), sin.contiguous())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(q.float(), expected_q.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k.float(), expected_k.float(), atol=tol, rtol=tol)
    assert torch.equal(v_view, v_before)  # v, beside q and k in the same buffer, is untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_in_place_then_normalizes_like_the_two_torch_steps(dtype):
    torch.manual_seed(2)
    norm = _norm_with_random_weight(dtype)
    residual, delta = (torch.randn(19, 96) * 3).to(dtype), torch.randn(19, 96).to(dtype)
    expected_sum = residual + delta
    expected = norm(expected_sum)
    got = kernels.load().add_rms_norm_(residual, delta, norm.weight, norm.eps)
    assert torch.equal(residual, expected_sum)  # the add is torch's, rounding included
    if dtype == torch.bfloat16:  # one rounding per step, as transformers' module does: bitwise the same
        assert torch.equal(got, expected)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_of_a_fused_gate_up_block(dtype):
    torch.manual_seed(3)
    gate_up = (torch.randn(13, 2 * 40) * 4).to(dtype)
    gate, up = gate_up.split(40, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = kernels.load().silu_and_mul(gate_up)
    assert got.shape == (13, 40)
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="2 \\* width"):
        kernels.load().silu_and_mul(gate_up[:, :-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 1000, 7])
def test_greedy_sample_is_argmax_and_flags_nan_and_inf_rows(dtype, vocab):
    """One pass per row: torch.argmax's token (first index on ties), and a flag for NaN / +inf rows; -inf is a
    legitimate logit. 16-lane chunks plus a tail (vocab 1000, 7), and the plain loop (float16)."""
    torch.manual_seed(vocab)
    logits = (torch.randn(9, vocab) * 4).to(dtype)
    logits[1, vocab // 2] = float("nan")
    logits[2, vocab - 1] = float("inf")
    logits[3, :] = float("-inf")
    logits[3, vocab // 3] = 0.0                      # one finite value among -inf
    logits[4, :] = 1.0                               # all tied: the first index
    logits[5, vocab - 1] = 1e4                       # the maximum in the tail
    logits[6, 0] = float("-inf")
    tokens, bad = kernels.load().greedy_sample(logits)
    assert bad.tolist() == [False, True, True, False, False, False, False, False, False]
    expected = logits.float().argmax(dim=-1)
    assert tokens[~bad].tolist() == expected[~bad].tolist()
    assert tokens[4] == 0 and tokens[5] == vocab - 1 and tokens[3] == vocab // 3


@pytest.mark.parametrize("k", [576, 100, 64, 33])
@pytest.mark.parametrize("n", [960, 37])
def test_gemv_matches_a_float_matmul_and_packed_linear_uses_it_for_few_rows(k, n):
    """The few-row bf16 GEMV (K and N tails included) against float32 math on the same bf16 inputs; and
    PackedLinear gives the same result whether a batch goes through it (1-2 rows) or oneDNN (3+ rows)."""
    from nanovllm.models.fast_path import PackedLinear, can_prepack

    compiled = kernels.load()
    torch.manual_seed(k + n)
    weight = (torch.randn(n, k) / k ** 0.5).bfloat16()
    bias = torch.randn(n).bfloat16()
    x = torch.randn(5, k).bfloat16()
    expected = x.float() @ weight.float().T + bias.float()
    if compiled.gemv_available():
        for rows in (1, 2, 5):
            got = compiled.gemv_bf16(x[:rows], weight, bias)
            torch.testing.assert_close(got.float(), expected[:rows], atol=2e-2, rtol=1e-2)
    else:  # no AVX-512 BF16: the kernel refuses, and PackedLinear (below) uses oneDNN for every row count
        with pytest.raises(RuntimeError, match="AVX-512 BF16"):
            compiled.gemv_bf16(x[:1], weight, bias)
    if can_prepack(weight):
        packed = PackedLinear(weight, bias, kernels=compiled)
        few, many = packed(x[:2]), packed(x)
        assert few.shape == (2, n) and many.shape == (5, n)
        torch.testing.assert_close(few.float(), many[:2].float(), atol=2e-2, rtol=1e-2)


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path):
    """torch's build lock waits forever for a build that was killed; one older than any real build is removed
    (with a warning), a fresh one (a build in progress elsewhere) is left alone."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    kernels._remove_stale_lock(tmp_path)
    assert lock.exists()
    old = time.time() - kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="interrupted kernel build"):
        kernels._remove_stale_lock(tmp_path)
    assert not lock.exists()
