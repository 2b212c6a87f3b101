"""Attention backends: the base interface and the built-in implementations (registered on import)."""

from nanovllm.attention.base import ATTENTION_BACKENDS, AttentionBackend, AttentionMetadata, register_attention

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "register_attention"]
