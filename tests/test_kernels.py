"""The fast path's fused C++ kernels against the torch code they replace (same math, float32 inside)."""

from __future__ import annotations

import pytest
import torch

from nanovllm import kernels
from nanovllm.models.llama import RMSNorm, apply_rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference_module(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    norm = norm.to(dtype)
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
