"""Shared pytest fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's Hugging Face tokenizer (converted model is cached after the first run)."""
    from transformers import AutoTokenizer

    from nanovllm.models.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model())
