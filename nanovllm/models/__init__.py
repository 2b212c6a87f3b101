"""Model definitions and weight loading: the model seam (``base``: ``CausalLM``, ``MODELS``, ``register_model``),
the Llama family (``llama``), the loader that picks a registered class by the checkpoint's ``architectures``."""

from nanovllm.models.base import MODELS, CausalLM, register_model
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.loader import resolve_model

__all__ = ["MODELS", "CausalLM", "LlamaForCausalLM", "register_model", "resolve_model"]
