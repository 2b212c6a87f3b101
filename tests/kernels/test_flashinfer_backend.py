"""attention=flashinfer on a machine without CUDA: registered, importable without the flashinfer package,
unavailable with one clear error that says why; float32 caches are refused (FlashInfer has no fp32 kernels).
Its kernels are checked on a GPU by tests/kernels/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from nanovllm import ATTENTION_BACKENDS, LLM
from nanovllm.attention.flashinfer_backend import FlashInferAttention


def test_flashinfer_is_registered_and_unavailable_without_cuda():
    assert ATTENTION_BACKENDS.get("flashinfer") is FlashInferAttention
    cpu = torch.device("cpu")
    assert not FlashInferAttention.is_available(cpu)
    assert "CUDA" in FlashInferAttention.unavailable_reason(cpu)
    assert ATTENTION_BACKENDS.get("torch").is_available(cpu)


def test_the_engine_says_why_flashinfer_cannot_run(llm):
    with pytest.raises(ValueError, match=r"attention backend 'flashinfer' cannot run on cpu: .*CUDA device"):
        LLM(attention="flashinfer", num_kv_blocks=16, max_model_len=256)


def test_a_float32_cache_is_refused_before_flashinfer_is_imported():
    backend = FlashInferAttention(num_heads=4, num_kv_heads=2, head_dim=8, scale=8 ** -0.5)
    cache = torch.zeros(4, 16, 2, 8)
    with pytest.raises(ValueError, match="needs dtype float16 or bfloat16.*got float32"):
        backend.bind_kv_caches([(cache, cache)])
