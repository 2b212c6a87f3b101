"""Model definitions and weight loading."""

from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.loader import resolve_model

__all__ = ["LlamaForCausalLM", "resolve_model"]
