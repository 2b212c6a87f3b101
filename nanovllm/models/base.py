"""The model seam: which class runs a checkpoint, chosen by the Hugging Face ``architectures`` name in its
``config.json`` (as vLLM's model registry does), and what the engine calls on it.

A new architecture is a ``CausalLM`` subclass registered under that name from a plugin file::

    from nanovllm import register_model
    from nanovllm.models.llama import LlamaForCausalLM

    @register_model("MyLlamaForCausalLM")
    class MyLlama(LlamaForCausalLM):
        ...

and chosen by any checkpoint whose ``config.json`` says ``"architectures": ["MyLlamaForCausalLM"]``
(``LLM(model=..., plugins=["my_model.py"])``, ``python -m nanovllm.run plugins=[my_model.py] model=...``).
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import torch
from torch import nn

from nanovllm.attention.base import AttentionBackend
from nanovllm.registry import Registry


class CausalLM(nn.Module, metaclass=abc.ABCMeta):
    """A causal LM over a flat batch of tokens (sequences concatenated, never padded), registered under the
    ``architectures`` name its checkpoints carry. What the engine calls, and when:

    - ``cls(hf_config, max_positions=...)``: once per load (``nanovllm.models.loader.load_model``), under
      ``torch.device(device)``; the loader then copies the checkpoint's safetensors into ``named_parameters()``
      by their Hugging Face names (the ``model.`` prefix dropped), casts the model to the engine's dtype and, when
      the engine runs fused layouts (``EngineConfig.fast_path``), calls ``use_fast_path``.
    - ``forward``: once per step of the real runner, over every token the step schedules.
    - ``compute_logits``: right after, on the rows the step samples.

    The harness's cost model (MFU/MBU) also reads ``linear_layers``, ``lm_head_layers`` and ``streamed_weights``,
    which ``LlamaForCausalLM`` (and so any model built on it) has.
    """

    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] for ``input_ids`` at ``positions`` ([num_tokens] each).
        ``attention`` is the backend planned for this step; pass it down, never store it (two engines may share
        one cached model)."""

    @abc.abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab_size] of the hidden states of the rows a step samples."""

    def use_fast_path(self, quantization: str | None = None) -> CausalLM:
        """Switch to fused, prepacked layouts (with ``quantization="int8"``, int8 linears); called once, after the
        weights are loaded and cast. A model without such layouts runs as it is, and refuses a quantization."""
        if quantization is not None:
            raise ValueError(f"model {type(self).__name__} has no quantization={quantization!r} path")
        return self


MODELS: Registry[CausalLM] = Registry("model architecture", base=CausalLM, builtin_packages=("nanovllm.models.llama",))


def register_model(name: str) -> Callable[[type[CausalLM]], type[CausalLM]]:
    """Class decorator registering a ``CausalLM`` subclass under the Hugging Face ``architectures`` name
    ``name`` (e.g. ``"LlamaForCausalLM"``): the loader picks it for every checkpoint whose config names it."""
    return MODELS.register(name)
