"""The model of a GGUF file built straight from its blocks (``quantization="gguf"``): the Llama-family model on
CPU, its linears over the file's own Q8_0 / Q4 blocks, norms and biases dense. Three modules, as vLLM splits
them: the file is parsed by ``gguf_reader``, the layers are ``quantized``'s, and this one (``GGUFWeights``,
``build_gguf_model``) turns the one into the other; neither of the two imports the model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from nanovllm.config import head_dim_of
from nanovllm.kernels import load as load_kernels
from nanovllm.models.llama import LlamaForCausalLM, RotaryEmbedding
from nanovllm.models.base import CausalLM
from nanovllm.models.gguf_reader import GGUF_BLOCK_TYPES, GGUF_DENSE_TYPES, gguf_head_name, read_gguf
from nanovllm.models.quantized import BLOCK, QuantEmbedding, QuantLinear


def build_gguf_model(model_class: type[CausalLM], hf_config, gguf_path: Path, dtype: torch.dtype,
                     max_positions: int) -> LlamaForCausalLM:
    """The Llama-family model of ``gguf_path`` (``model_class``, the registered class of its architecture) on
    CPU, its linears over the file's own blocks, norms and biases dense in ``dtype``, in the fast path's layout
    (fused q/k/v and gate/up, the CPU kernels)."""
    if not issubclass(model_class, LlamaForCausalLM):
        raise ValueError(f"quantization='gguf' builds Llama-family models (LlamaForCausalLM and its subclasses); "
                         f"this checkpoint's architecture runs {model_class.__name__}: use quantization=None")
    kernels = load_kernels()
    weights = GGUFWeights(gguf_path, hf_config, kernels)
    weights.check_types()
    with torch.device("meta"):  # the dense weights are never allocated
        model = model_class(hf_config, max_positions=max_positions)
    model.rotary = RotaryEmbedding(hf_config, head_dim_of(hf_config), max_positions)
    model.rotary.cos, model.rotary.sin = model.rotary.cos.to(dtype), model.rotary.sin.to(dtype)

    def norm(module, name: str) -> None:
        module.weight = nn.Parameter(weights.dense(name).to(dtype), requires_grad=False)
        module.kernels = kernels

    def linears(*names: str) -> QuantLinear:
        parts = [weights.linear(f"{name}.weight", f"{name}.bias") for name in names]
        layer = parts[0] if len(parts) == 1 else QuantLinear.concat(parts)
        layer.to_activation_dtype(dtype)
        return layer

    for i, layer in enumerate(model.decoder_layers()):
        blk = f"blk.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = linears(f"{blk}.attn_q", f"{blk}.attn_k", f"{blk}.attn_v")
        attn.o_proj = linears(f"{blk}.attn_output")
        del attn.q_proj, attn.k_proj, attn.v_proj
        if attn.qk_norm:
            norm(attn.q_norm, f"{blk}.attn_q_norm.weight")
            norm(attn.k_norm, f"{blk}.attn_k_norm.weight")
        attn.kernels = kernels
        mlp.gate_up_proj = linears(f"{blk}.ffn_gate", f"{blk}.ffn_up")
        mlp.down_proj = linears(f"{blk}.ffn_down")
        del mlp.gate_proj, mlp.up_proj
        mlp.kernels = kernels
        norm(layer.input_layernorm, f"{blk}.attn_norm.weight")
        norm(layer.post_attention_layernorm, f"{blk}.ffn_norm.weight")
    norm(model.norm, "output_norm.weight")
    embedding = weights.linear("token_embd.weight")
    model.embed_tokens = QuantEmbedding(embedding, dtype)
    head_name = gguf_head_name(weights.tensors)
    head = embedding if head_name == "token_embd.weight" else weights.linear(head_name)
    model.lm_head = head
    model.lm_head_chunks = nn.ModuleList([head])
    model.kernels = kernels
    model.fast_path = True
    return model.eval().requires_grad_(False)


class GGUFWeights:
    """The tensors of one GGUF file, read through a memory map: ``linear(name)`` gives a ``QuantLinear`` over a
    quantized tensor's blocks, ``dense(name)`` a float tensor."""

    def __init__(self, path: Path, hf_config, kernels) -> None:
        self.path = Path(path)
        metadata, self.tensors = read_gguf(self.path)
        self.architecture = str(metadata.get("general.architecture", ""))
        self.hf_config = hf_config
        self.kernels = kernels

    def has(self, name: str) -> bool:
        return name in self.tensors

    def check_types(self) -> None:
        """Refuse, by tensor name and type, a file with blocks the kernel does not run."""
        for name, tensor in self.tensors.items():
            kind = tensor.kind
            if kind not in GGUF_BLOCK_TYPES + GGUF_DENSE_TYPES:
                raise ValueError(
                    f"quantization='gguf' runs {', '.join(GGUF_BLOCK_TYPES)} blocks (and dense tensors); "
                    f"{self.path.name}'s tensor {name!r} is {kind}: use quantization=None, which dequantizes any GGUF")

    def dense(self, name: str) -> torch.Tensor:
        """A dense tensor (norm weights, biases) as float32, in transformers' shape."""
        tensor = self.tensors[name]
        kind = tensor.kind
        if kind in GGUF_BLOCK_TYPES:
            return self.linear(name).dequantize()
        data = np.asarray(tensor.data)
        if kind == "BF16":
            data = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(tuple(int(d) for d in reversed(tensor.shape)))

    def linear(self, name: str, bias: str | None = None) -> QuantLinear:
        """A ``QuantLinear`` over the blocks of tensor ``name`` ([N, K] as transformers has it: GGUF's q and k
        rows of Llama models are re-ordered back, as transformers' own GGUF reader does)."""
        tensor = self.tensors[name]
        kind = tensor.kind
        if kind not in GGUF_BLOCK_TYPES:
            raise ValueError(f"tensor {name!r} is {kind}, not one of the quantized types {GGUF_BLOCK_TYPES}")
        k, n = (int(d) for d in tensor.shape[:2])
        raw = np.asarray(tensor.data).reshape(n, k // BLOCK, -1)
        rows = self._row_order(name, n)
        if rows is not None:
            raw = raw[rows]
        scale = _half(raw[:, :, 0:2])
        if kind == "Q8_0":
            fmt, codes, mins = "q8_0", raw[:, :, 2:].reshape(n, k).view(np.int8), None
        elif kind == "Q4_1":
            fmt, codes, mins = "q4_1", raw[:, :, 4:].reshape(n, k // 2), _half(raw[:, :, 2:4])
        else:  # Q4_0: w = d (q - 8), i.e. Q4_1 with m = -8 d (exact in float16: a power of two)
            fmt, codes, mins = "q4_0", raw[:, :, 2:].reshape(n, k // 2), scale * -8
        bias_tensor = self.dense(bias) if bias is not None and self.has(bias) else None
        return QuantLinear(fmt, torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scale),
                           None if mins is None else torch.from_numpy(mins), bias_tensor, k, self.kernels)

    def _row_order(self, name: str, n: int) -> np.ndarray | None:
        """llama.cpp's converter interleaves the rows of each head of Llama q and k for its RoPE layout;
        transformers reverses that on load (LlamaTensorProcessor), and so do we, on row indices."""
        if self.architecture != "llama" or not (".attn_q." in name or ".attn_k." in name):
            return None
        heads = self.hf_config.num_attention_heads if ".attn_q." in name else self.hf_config.num_key_value_heads
        return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(n)


def _half(raw: np.ndarray) -> np.ndarray:
    """float16 values from their little-endian byte pairs [..., 2]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].copy()
