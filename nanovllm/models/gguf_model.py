"""The model of a GGUF file built straight from its blocks (``quantization="gguf"``): the Llama-family model on
CPU, its linears over the file's own Q8_0 / Q4 blocks (``nanovllm.models.quantized``), norms and biases dense.
Apart from the quantized layers so that ``quantized`` need not import the model it is used by."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from nanovllm.config import head_dim_of
from nanovllm.kernels import load as load_kernels
from nanovllm.models.llama import LlamaForCausalLM, RotaryEmbedding
from nanovllm.models.quantized import GGUFWeights, QuantEmbedding, QuantLinear, gguf_head_name


def build_gguf_model(hf_config, gguf_path: Path, dtype: torch.dtype, max_positions: int):
    """The Llama-family model of ``gguf_path`` on CPU, its linears over the file's own blocks, norms and
    biases dense in ``dtype``, in the fast path's layout (fused q/k/v and gate/up, the CPU kernels)."""
    kernels = load_kernels()
    weights = GGUFWeights(gguf_path, hf_config, kernels)
    weights.check_types()
    with torch.device("meta"):  # the dense weights are never allocated
        model = LlamaForCausalLM(hf_config, max_positions=max_positions)
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

    for i, layer in enumerate(model.layers):
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
