"""The Llama family (Llama, SmolLM2, Qwen2, Qwen3) over a flat batch of tokens.

Every tensor is [num_tokens, ...]: sequences are concatenated, never padded; attention finds its sequences
through the backend's per-step plan. The arithmetic mirrors transformers' reference implementation step by step
(RMSNorm in float32, RoPE tables from the same inverse frequencies, and the same projection shapes, so every
matmul is bitwise the same), which is what keeps greedy output token-identical to it. ``use_fast_path()``
switches a loaded model to the fast layouts (fused q/k/v and gate/up, prepacked oneDNN weights; see
``fast_path.py``) and, on CPU, fused C++ kernels (``nanovllm/csrc``: RMSNorm, residual add + RMSNorm, rotary,
SiLU-and-mul), which trade that bitwise equality for speed and are held to the close standard instead. There the
layers run as one C++ loop over those kernels (``decoder_stack()``, ``nanovllm/csrc/decoder_stack.cpp``) where
every layer and the step's attention allow it, bitwise the same as the Python loop and without its per-call cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanovllm.attention.base import AttentionBackend
from nanovllm.config import attention_biases, head_dim_of
from nanovllm.kernels import CompiledDecoderStack, Kernels, load as load_kernels
from nanovllm.models.base import CausalLM, register_model
from nanovllm.models.fast_path import PackedLinear, can_prepack, fuse_linears, prepack
from nanovllm.models.quantized import QuantEmbedding, QuantLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: Kernels | None = None  # the fused C++ kernel, set by use_fast_path() on CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, computed once like transformers does."""

    cos: torch.Tensor  # buffers, registered in __init__
    sin: torch.Tensor

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        rope_type = _rope_parameters(config).get("rope_type", "default")
        if rope_type == "default":
            theta = _rope_parameters(config).get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        # float32 copies that model.to(dtype) leaves alone: the fused rotary kernel computes in float32.
        self.cos_float = self.cos.clone()
        self.sin_float = self.sin.clone()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows [num_tokens, 1, head_dim] for ``positions``, in ``dtype``: looked up once per step
        and shared by every layer."""
        cos = self.cos.index_select(0, positions).to(dtype)[:, None, :]
        sin = self.sin.index_select(0, positions).to(dtype)[:, None, :]
        return cos, sin

    def float_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin rows [num_tokens, head_dim] for the fused rotary kernel."""
        return self.cos_float.index_select(0, positions), self.sin_float.index_select(0, positions)


def apply_rotary(rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
    cos, sin = rope
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(params)


class Attention(nn.Module):
    def __init__(self, config, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias, o_bias = attention_biases(config)
        self.q_proj = nn.Linear(config.hidden_size, self.q_size, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_size, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_size, bias=qkv_bias)
        # nn.Linear; on the fast path a prepacked or quantized linear (PackedLinear, QuantLinear)
        self.o_proj: nn.Module = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qkv_proj: nn.Module | None = None  # set by use_fast_path()
        self.kernels: Kernels | None = None  # the fused rotary kernel, set by use_fast_path() on CPU

    def use_fast_path(self, kernels: Kernels | None, quantization: str | None = None) -> None:
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj
        prepack(self, ("qkv_proj", "o_proj"), kernels, quantization)
        self.kernels = kernels

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                attention: AttentionBackend) -> torch.Tensor:
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kernels is not None:
            self.kernels.rotary_(q, k, *rope)  # in place, on the fused projection's output
        else:
            q, k = apply_rotary(rope, q, k)
        return self.o_proj(attention.forward(self.layer, q, k, v))


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        # nn.Linear; on the fast path a prepacked or quantized linear (PackedLinear, QuantLinear)
        self.down_proj: nn.Module = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj: nn.Module | None = None  # set by use_fast_path()
        self.kernels: Kernels | None = None  # the fused silu-and-mul kernel, set by use_fast_path() on CPU

    def use_fast_path(self, kernels: Kernels | None = None, quantization: str | None = None) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj
        prepack(self, ("gate_up_proj", "down_proj"), kernels, quantization)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            if self.kernels is not None and gate_up.dim() == 2:
                return self.down_proj(self.kernels.silu_and_mul(gate_up))
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                attention: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), attention)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, rope: tuple[torch.Tensor, torch.Tensor], residual: torch.Tensor,
                      delta: torch.Tensor | None, attention: AttentionBackend) -> torch.Tensor:
        """The fast path's layer (fused C++ kernels), arranged as vLLM's: ``residual`` is the residual stream,
        updated in place; ``delta`` is the previous layer's MLP output, not yet added (None for the first
        layer). Returns this layer's MLP output, which the next layer (or the final norm) adds. Every residual
        add thus runs inside a fused add+RMSNorm kernel; the arithmetic, and so the result, is the same as
        ``forward``'s with those kernels."""
        kernels, first, second = self.input_layernorm.kernels, self.input_layernorm, self.post_attention_layernorm
        assert kernels is not None  # the fast path's layers run here only with the kernels (forward's check)
        normed = first(residual) if delta is None else kernels.add_rms_norm_(residual, delta, first.weight, first.eps)
        attended = self.self_attn(rope, normed, attention)
        return self.mlp(kernels.add_rms_norm_(residual, attended, second.weight, second.eps))


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(CausalLM):
    """Llama-architecture causal LM; ``config.model_type`` selects the Qwen2 (qkv bias) and Qwen3 (q/k norm)
    variations, registered under their own architecture names below."""

    SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        if config.model_type not in self.SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported; supported: {', '.join(self.SUPPORTED_MODEL_TYPES)}"
            )
        window = getattr(config, "sliding_window", None)
        if window is not None and window < max_positions:
            # Every layer here attends to the whole sequence: past the window it would differ from the checkpoint.
            raise ValueError(f"sliding_window={window} (below the model's {max_positions} positions) is not "
                             "supported: this model attends to every earlier token")
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # A model built from a GGUF file's blocks (gguf_model) holds both as quantized layers.
        self.embed_tokens: nn.Embedding | QuantEmbedding = embed_tokens
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head: nn.Linear | QuantLinear = lm_head
        if config.tie_word_embeddings:
            lm_head.weight = embed_tokens.weight
        self.rotary = rotary
        self.lm_head_chunks: nn.ModuleList | None = None  # prepacked LM head slices, set by use_fast_path()
        self.kernels: Kernels | None = None  # fused C++ kernels (RMSNorm, rotary), set by use_fast_path() on CPU
        self.fast_path = False
        # With the fused kernels, run the decoder layers as one C++ loop where it applies (decoder_stack()).
        # False keeps the Python loop (same kernels, bitwise the same result): the tests compare the two.
        self.use_decoder_stack = True
        # (the layer list it was built from, the stack or None)
        self._decoder_stack: tuple[nn.ModuleList, CompiledDecoderStack | None] | None = None

    def use_fast_path(self, quantization: str | None = None) -> "LlamaForCausalLM":
        """Switch to the fast layouts (fused projections; prepacked weights on CPU; with
        ``quantization="int8"``, int8 W8A8 linears and LM head). Call after the weights are loaded and cast;
        irreversible."""
        assert isinstance(self.lm_head, nn.Linear)  # loaded dense: a GGUF-built model is built in the fast layout
        on_cpu = self.lm_head.weight.device.type == "cpu"
        kernels = load_kernels() if on_cpu else None
        for layer in self.decoder_layers():
            layer.self_attn.use_fast_path(kernels, quantization)
            layer.mlp.use_fast_path(kernels, quantization)
            layer.input_layernorm.kernels = layer.post_attention_layernorm.kernels = kernels
        self.norm.kernels = kernels
        self.kernels = kernels
        weight = self.lm_head.weight
        if quantization == "int8":
            # One layer for the whole head: the int8 kernel streams any number of rows (no chunking to help).
            self.lm_head_chunks = nn.ModuleList([QuantLinear.from_dense_int8(weight, None, kernels)])
        elif can_prepack(weight, kernels):
            self.lm_head_chunks = nn.ModuleList(PackedLinear(w, kernels=kernels)
                                                     for w in weight.detach().split(self.LOGITS_CHUNK))
        self.fast_path = True
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm. ``attention`` is the backend planned for
        this step; it is passed down explicitly (never stored on the layers), so two engines can share one
        cached model without touching each other's KV caches."""
        x = self.embed_tokens(input_ids)
        if self.kernels is not None:
            rope = self.rotary.float_rows(positions)
        else:
            rope = self.rotary.tables(positions, x.dtype)
        if self.kernels is not None:
            residual = x.contiguous()  # x is this step's own tensor: updated in place from here on
            delta: torch.Tensor | None = None
            step = self._stack_step(attention)
            if step is not None:
                stack, attention_args = step
                return stack.forward(residual, *rope, *attention_args)
            for fused in self.decoder_layers():
                delta = fused.forward_fused(rope, residual, delta, attention)
            assert delta is not None  # a model has at least one layer
            return self.kernels.add_rms_norm_(residual, delta, self.norm.weight, self.norm.eps)
        for layer in self.layers:
            x = layer(rope, x, attention)
        return self.norm(x)

    def decoder_layers(self) -> list[DecoderLayer]:
        """``layers`` as their class: every model of the family builds ``DecoderLayer``s (a shard's are copies of
        them)."""
        layers = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layers.append(layer)
        return layers

    def decoder_stack(self) -> CompiledDecoderStack | None:
        """The fast path's decoder layers as one C++ loop (``nanovllm/csrc/decoder_stack.cpp``: the same kernels
        ``forward_fused`` calls, in the same order, without a Python call around each), built on first use; None
        where a layer is not the plain fused one: q/k norm (Qwen3), tensor-parallel shards, a subclassed layer, a
        linear whose kernel the stack does not call. Built per layer list, so a
        shallow copy with its own layers (``shard_model``) never runs the original's."""
        if self._decoder_stack is None or self._decoder_stack[0] is not self.layers:
            self._decoder_stack = (self.layers, _build_decoder_stack(self))
        return self._decoder_stack[1]

    def _stack_step(self, attention: AttentionBackend) -> tuple[CompiledDecoderStack, tuple] | None:
        """``(stack, attention arguments)`` for running this step's decoder layers as the C++ loop, or None to
        run the Python loop: the stack is off or unavailable, the backend is not the CPU kernel alone
        (``CpuAttention.kernel_step``), or a profiler is recording (it then sees every kernel as its own op, as
        ``nanovllm.profile`` reports them)."""
        if not self.use_decoder_stack or torch.autograd.profiler._is_profiler_enabled:
            return None
        kernel_step = getattr(attention, "kernel_step", None)
        if kernel_step is None:
            return None
        stack = self.decoder_stack()
        if stack is None:
            return None
        attention_args = kernel_step(self.kernels)
        return None if attention_args is None else (stack, attention_args)

    def linear_layers(self) -> list[nn.Linear | PackedLinear | QuantLinear]:
        """Every module that is one matmul of the decoder layers (nn.Linear, a prepacked or a quantized linear)."""
        return [m for m in self.layers.modules() if isinstance(m, (nn.Linear, PackedLinear, QuantLinear))]

    def lm_head_layers(self) -> list[nn.Module]:
        """The LM head as ``compute_logits`` runs it: its prepacked or quantized slices, else the plain linear."""
        return list(self.lm_head_chunks) if self.lm_head_chunks is not None else [self.lm_head]

    def streamed_weights(self) -> tuple[int, int]:
        """(bytes, weights) of the matmul weights one forward pass streams from memory, the decoder layers' and the
        LM head's, as stored: 2 or 4 bytes a weight when dense, about 1 for int8 codes and their scales, 0.7 for
        the default GGUF's Q4_1 and Q8_0 blocks. The embedding is left out (a lookup reads only the batch's rows).
        The harness's cost model (``ModelCost.from_model``) takes the bytes per weight of its MBU from it."""
        total_bytes = total_weights = 0
        for layer in self.linear_layers() + self.lm_head_layers():
            assert isinstance(layer, (nn.Linear, PackedLinear, QuantLinear))  # an LM head chunk is one of them
            total_bytes += (layer.weight.numel() * layer.weight.element_size() if isinstance(layer, nn.Linear)
                            else layer.num_bytes)
            total_weights += layer.in_features * layer.out_features
        return total_bytes, total_weights

    # Vocabulary rows per LM-head matmul. One [rows, 49152] GEMM runs slower on CPU than the same work in
    # 8192-row slices, whose weight slice stays in cache while every row passes; the results are bitwise identical.
    LOGITS_CHUNK = 8192

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_chunks is not None:
            if len(self.lm_head_chunks) == 1:  # one quantized head: no copy through torch.cat
                return self.lm_head_chunks[0](hidden)
            return torch.cat([chunk(hidden) for chunk in self.lm_head_chunks], dim=-1)
        assert isinstance(self.lm_head, nn.Linear)  # a quantized head (GGUF) is always in lm_head_chunks
        weight = self.lm_head.weight
        if hidden.device.type != "cpu" or weight.shape[0] <= self.LOGITS_CHUNK:
            return self.lm_head(hidden)
        return torch.cat([F.linear(hidden, w) for w in weight.split(self.LOGITS_CHUNK)], dim=-1)


def _build_decoder_stack(model: LlamaForCausalLM) -> CompiledDecoderStack | None:
    """A ``kernels.DecoderStack`` over ``model``'s layers, or None where one of them is not the plain fused
    layer (``LlamaForCausalLM.decoder_stack`` says which)."""
    kernels = model.kernels
    if kernels is None or not hasattr(kernels, "DecoderStack") or len(model.layers) == 0:
        return None
    eps = model.norm.eps
    shape = None  # the first layer's (num_heads, num_kv_heads, head_dim), which every layer must have
    norms = [model.norm]
    parts = []
    for layer in model.layers:
        if type(layer) is not DecoderLayer:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        if (type(attn) is not Attention or type(mlp) is not MLP or attn.qk_norm
                or attn.qkv_proj is None or mlp.gate_up_proj is None):
            return None
        shape = shape or (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != shape:
            return None
        linears = []
        for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            make = getattr(module, "stack_linear", None)
            if type(module) is nn.Linear and module.weight.device.type == "cpu":
                # A plain linear (bf16 at the scalar level, where no packed kernel takes it): torch's linear, as
                # its forward.
                bias = None if module.bias is None else module.bias.detach()
                linear = kernels.stack_linear("aten", module.weight.detach(), None, None, bias, module.out_features)
            else:
                linear = make() if make is not None and getattr(module, "kernels", None) is kernels else None
            if linear is None:
                return None
            linears.append(linear)
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        qkv, o, gate_up, down = linears
        parts.append((layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                      qkv, o, gate_up, down))
    if any(norm.eps != eps or norm.kernels is not kernels for norm in norms):
        return None
    assert shape is not None  # model.layers is not empty
    stack = kernels.DecoderStack(*shape, eps, model.norm.weight.detach())
    for part in parts:
        stack.add_layer(*part)
    return stack


# The Llama family's other architecture names: the same layers, the differences read from the config
# (``attention_biases``: Qwen2's q/k/v biases; ``qk_norm``: Qwen3's q/k norms; Mistral without a sliding window).
@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on q/k/v."""


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with RMSNorm on each head's q and k."""


@register_model("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layers; a checkpoint with a sliding window shorter than its positions is refused."""
