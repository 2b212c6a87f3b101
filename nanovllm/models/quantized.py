"""Quantized weights: ``quantization="int8"`` (W8A8) and ``quantization="gguf"`` (the GGUF file's own blocks).

Both run nano-vllm's quantized GEMM (``nanovllm/csrc/quant_gemm.cpp``), which reads the packed weights and
unpacks them in registers, the activations quantized to int8 on the fly; no dequantized copy of a weight is ever
made. Where the kernel build has them, Q4 layers are stored interleaved by 16 output features (``pack_q4x16``,
the ``q4x16_linear`` kernel) and int8 ones in the AMX tiles' layout or interleaved likewise (``int8_kernel``);
``QuantLinear.kernel``
says which, and ``canonical()`` gives back the plain layout. Activations, norms, attention and the KV cache
stay in the engine's ``dtype``.

- ``int8``: W8A8 made at load from the dense weights: symmetric int8 per output channel (scale = max |w| / 127
  of the row, vLLM's int8 weights), every linear layer, the LM head included (on this model a fifth of the
  weights). Activations get dynamic scales: on CPUs with AMX-INT8 (``int8_kernel``) one scale per token on the
  tiles (``nanovllm/csrc/int8_amx.cpp``, weights stored in the tiles' layout), in one int8 digit (vLLM's dynamic
  per-token scheme) or two, per projection (``INT8_ACTIVATION_DIGITS``); elsewhere per token and group of 32
  values, in ``i8x16_linear`` (weights interleaved by 16 features; AVX-512 VNNI or AVX2) or the row kernel.
  docs/quantization.md has what each scheme costs in perplexity and the command that measures it.
- ``gguf``: the blocks of a GGUF file as they are stored: Q8_0, Q4_0 and Q4_1 (the default model is Q4_1, its
  embedding Q8_0), activations per 32 values as llama.cpp quantizes them for these blocks. The model is built
  straight from the file (memory-mapped; the blocks are only split into code, scale and offset arrays) without the
  dense conversion, so it loads in a fraction of the time and memory. Tensor types other than those (K-quants and
  the like) are refused by name: ``quantization=None`` runs any GGUF, dequantized.

The accuracy these cost is measured against the dense bf16 path by ``python -m nanovllm.validate
--quantization ...`` (perplexity on held-out text and greedy agreement; the margins in ``QUANTIZED_PPL_MARGIN``).
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm import machine

QUANTIZATIONS = ("int8", "gguf")
BLOCK = 32                                     # weights per GGUF block, activation values per scale
# The kernel's weight formats (QuantFormat in quant_gemm.cpp); Q4_0 runs as Q4_1 with offset m = -8 d.
FORMAT_IDS = {"int8": 0, "q8_0": 1, "q4_1": 2, "q4_0": 2}
# The int8 digits per token of each projection's activations on the AMX tiles (the other kernels quantize per 32
# values and ignore this). A second digit doubles the tile products, which bound a prefill on tiles, so a
# projection takes one where one keeps the quantized standard: o_proj (attention's output) and gate_up_proj. q/k/v
# keep two (their errors pass through the softmax's exponential), and so does down_proj (SiLU(gate) x up, where
# a few tokens' outliers set the scale): one digit there moves greedy tokens off the dense path's top-5.
# ``experiments/int8_activation_schemes.py`` measures every choice; docs/quantization.md has the table. Names not
# listed (the LM head) take two.
INT8_ACTIVATION_DIGITS = {"qkv_proj": 2, "o_proj": 1, "gate_up_proj": 1, "down_proj": 2}


def int8_kernel_at(isa: str, flags: frozenset[str]) -> str:
    """The kernel an int8 linear gets at ISA level ``isa`` on a CPU with ``/proc/cpuinfo`` ``flags``: ``amx``
    (AMX-INT8 tiles: the ``amx`` level on a CPU with ``amx_int8``), ``i8x16`` (interleaved by 16 features: VNNI in
    the ``avx512_bf16`` build, AVX2 in the ``avx2`` and ``avx512`` builds) or ``vector`` (quant_gemm.cpp's row
    kernel, the scalar build). Pure, so tests can ask it for CPUs they do not run on; ``int8_kernel`` applies it
    to this machine."""
    if isa == "amx" and "amx_int8" in flags:
        return "amx"
    return "vector" if isa == "scalar" else "i8x16"


def int8_kernel(kernels) -> str:
    """The kernel an int8 linear runs with the compiled ``kernels`` (None: ``vector``, the torch fallback):
    ``int8_kernel_at`` for the level in force and this CPU's flags, within what that build runs (a build without
    the tiles, or an OS that refuses this process them, gets ``i8x16``; the scalar build ``vector``). Called when
    a ``QuantLinear`` is built."""
    if kernels is None:
        return "vector"
    if int8_kernel_at(machine.selected_isa(), machine.cpu_flags()) == "amx" and kernels.int8_amx_available():
        return "amx"
    return "i8x16" if kernels.i8x16_available() else "vector"


def int8_weight_bytes(kernel: str, out_features: int, in_features: int) -> int:
    """Bytes an int8 linear of ``kernel`` stores and a forward pass reads: its codes in that kernel's layout and
    its float32 channel scales. ``amx``: 16-feature blocks, K padded to 64 (``pack_int8_amx``); ``i8x16``: N
    padded to 64 features, codes and scales (``pack_i8x16``); ``vector``: [N, K] codes and [N] scales."""
    if kernel == "amx":
        return -(-out_features // 16) * 16 * (-(-in_features // 64) * 64) + 4 * out_features
    if kernel == "i8x16":
        padded = -(-out_features // Q4X16_ITEM) * Q4X16_ITEM
        return padded * in_features + 4 * padded
    return out_features * in_features + 4 * out_features


class QuantLinear(nn.Module):
    """A linear layer over quantized weights (``qweight`` codes, ``scales``, ``mins`` for Q4), run on every row
    count by the kernel ``kernel`` names: ``vector`` (the kernels' ``quant_linear`` op), ``amx`` (int8 on AMX-INT8
    tiles, ``int8_amx_linear``), ``q4x16`` (Q4 interleaved by 16 features, ``q4x16_linear``), ``i8x16`` (int8
    interleaved likewise, ``i8x16_linear``, on AVX2 and VNNI CPUs without AMX-INT8) or ``q8x16`` (GGUF's Q8_0
    interleaved likewise, ``q8x16_linear``, the avx2 and avx512 builds), chosen at
    construction from the CPU and the kernel build. ``activation_digits`` (1 or 2): the int8 digits per token
    of the activations on the ``amx`` kernel (``INT8_ACTIVATION_DIGITS``). Built at load (``from_dense_int8``,
    ``GGUFWeights.linear``); the engine only calls ``forward``."""

    def __init__(self, fmt: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bias: torch.Tensor | None, in_features: int, kernels, activation_digits: int = 2) -> None:
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"quantized linears need in_features divisible by {BLOCK}, got {in_features}")
        if activation_digits not in (1, 2):
            raise ValueError(f"activation_digits must be 1 or 2, got {activation_digits}")
        self.activation_digits = activation_digits
        self.fmt = fmt
        self.format_id = FORMAT_IDS[fmt]
        self.qweight, self.scales, self.mins, self.bias = qweight, scales, mins, bias
        self.in_features, self.out_features = in_features, qweight.shape[0]
        self.kernels = kernels
        self.kernel = "vector"
        int8 = int8_kernel(kernels) if fmt == "int8" else None
        if int8 == "amx":
            # Stored once in the tiles' layout (unsigned, padded to whole tiles); ``codes()`` gives them back.
            self.kernel = "amx"
            self.qweight = kernels.pack_int8_amx(qweight)
        elif int8 == "i8x16":
            # Interleaved by 16 features as unsigned w + 128, channel scales padded alike: ``canonical()`` undoes it.
            self.kernel = "i8x16"
            self.qweight, self.scales = pack_i8x16(qweight, scales)
        elif fmt in ("q4_1", "q4_0") and kernels is not None and kernels.q4x16_available():
            # Interleaved by 16 features (the same 4-bit codes and fp16 scales, moved): ``canonical()`` undoes it.
            self.kernel = "q4x16"
            assert mins is not None  # Q4 blocks carry their offsets (Q4_0's made from its scales)
            self.qweight, self.scales, self.mins = pack_q4x16(qweight, scales, mins)
        elif fmt == "q8_0" and kernels is not None and kernels.q8x16_available():
            # Interleaved likewise (codes as unsigned w + 128, fp16 block scales as Q4's): ``canonical()`` undoes it.
            self.kernel = "q8x16"
            self.qweight, self.scales = pack_q8x16(qweight, scales)

    @classmethod
    def from_dense_int8(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernels,
                        activation_digits: int = 2) -> "QuantLinear":
        """Symmetric per-output-channel int8 of a dense ``weight`` [N, K] (vLLM's W8A8 weight scheme)."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=1) / 127.0
        codes = torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls("int8", codes.contiguous(), scale.contiguous(), None, _bias(bias, weight.dtype), w.shape[1],
                   kernels, activation_digits)

    def canonical(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes, scales, mins) in the vector kernel's layout ([N, K] int8 or [N, K / 2] packed 4-bit codes,
        [N] or [N, K / 32] scales), of all rows or of ``rows`` (indices), whatever layout this layer stores."""
        if self.kernel == "q4x16":
            assert self.mins is not None  # set with the Q4 layout (__init__)
            return unpack_q4x16(self.qweight, self.scales, self.mins, self.out_features, rows)
        if self.kernel == "i8x16":
            return unpack_i8x16(self.qweight, self.scales, self.out_features, rows)
        if self.kernel == "q8x16":
            return unpack_q8x16(self.qweight, self.scales, self.out_features, rows)
        codes = self.qweight
        if self.kernel == "amx":  # [blocks, K' / 4, 16, 4] of w + 128 -> [N, K] int8
            k_padded = codes.shape[1] // 16
            blocks = codes.view(-1, k_padded // 4, 16, 4).permute(0, 2, 1, 3).reshape(-1, k_padded)
            codes = (blocks[: self.out_features, : self.in_features].to(torch.int16) - 128).to(torch.int8)
        if rows is None:
            return codes.contiguous(), self.scales, self.mins
        return (codes.index_select(0, rows), self.scales.index_select(0, rows),
                None if self.mins is None else self.mins.index_select(0, rows))

    def codes(self) -> torch.Tensor:
        """The weight codes in the vector kernel's layout ([N, K] int8, or [N, K / 2] packed 4-bit)."""
        return self.canonical()[0]

    @classmethod
    def concat(cls, parts: list["QuantLinear"]) -> "QuantLinear":
        """One layer computing the concatenation of ``parts``' outputs (same input, same format): the fused
        q/k/v and gate/up projections. Quantized rows are independent, so this is a concatenation of rows."""
        first = parts[0]
        if any(p.fmt != first.fmt or p.in_features != first.in_features for p in parts):
            raise ValueError("quantized projections fused into one must share their format and input width")
        biases = [p.bias for p in parts]
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(p.out_features, dtype=first_dtype(biases))
                              for b, p in zip(biases, parts)])
        else:
            bias = None
        canonical = [p.canonical() for p in parts]
        mins = None if first.mins is None else torch.cat([_offsets(c[2]) for c in canonical])
        return cls(first.fmt, torch.cat([c[0] for c in canonical]), torch.cat([c[1] for c in canonical]), mins,
                   bias, first.in_features, first.kernels, max(p.activation_digits for p in parts))

    def to_activation_dtype(self, dtype: torch.dtype) -> None:
        """Cast the bias to the model's activation dtype (the kernel adds it in that dtype)."""
        if self.bias is not None:
            self.bias = self.bias.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        # Through the dispatcher (the kernels' library registers it) so profiles count it as a linear.
        if self.kernel == "amx":
            y = self.kernels.int8_amx_linear_op(flat, self.qweight, self.scales, self.bias, self.out_features,
                                                self.activation_digits)
        elif self.kernel == "q4x16":
            y = self.kernels.q4x16_linear_op(flat, self.qweight, self.scales, self.mins, self.bias, self.out_features)
        elif self.kernel == "i8x16":
            y = self.kernels.i8x16_linear_op(flat, self.qweight, self.scales, self.bias, self.out_features)
        elif self.kernel == "q8x16":
            y = self.kernels.q8x16_linear_op(flat, self.qweight, self.scales, self.bias, self.out_features)
        else:
            y = self.kernels.quant_linear_op(flat, self.qweight, self.scales, self.mins, self.bias, self.format_id)
        return y.reshape(*x.shape[:-1], self.out_features)

    def stack_linear(self):
        """This layer as the C++ decoder stack runs it (``kernels.stack_linear``: the same kernel and arguments as
        ``forward``), or None without compiled kernels. Called once, when the model builds its stack."""
        if self.kernels is None:
            return None
        return self.kernels.stack_linear(self.kernel, self.qweight, self.scales, self.mins, self.bias,
                                         self.out_features, self.format_id,
                                         activation_digits=self.activation_digits)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] these codes stand for (tests and the reference comparison; never on the
        serving path)."""
        return dequantize(self.fmt, *self.canonical())

    @property
    def per_token_activations(self) -> bool:
        """Whether this layer's kernel scales its activations once per token (the AMX tiles, in
        ``activation_digits`` digits) rather than per 32 values (every other kernel)."""
        return self.kernel == "amx"

    @property
    def num_bytes(self) -> int:
        """Bytes of weight data (codes, scales, offsets) a forward pass reads."""
        parts = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def kernel_name(self) -> str:
        """What runs this layer, for the profile: the format and the kernel build's vector path, or the tiles."""
        if self.kernel == "amx":
            digits = "two digits" if self.activation_digits == 2 else "one digit"
            return f"int8_amx_linear int8 (AMX-INT8 tiles, activations per token in {digits})"
        if self.kernel in ("q4x16", "i8x16", "q8x16"):
            return (f"{self.kernel}_linear {self.fmt} int8-dot, interleaved by 16 features "
                    f"({self.kernels.quant_gemm_isa()})")
        return f"quant_linear {self.fmt} int8-dot ({self.kernels.quant_gemm_isa()})"

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"


Q4X16_FEATURES, Q4X16_ITEM = 16, 64  # features per interleaved block; the kernel's work item (N padded to it)


def pack_q4x16(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
    """Q4 blocks ([N, K / 2] codes, [N, K / 32] fp16 scales and offsets) interleaved by 16 output features for
    ``q4x16_linear`` (``nanovllm/csrc/quant_gemm.cpp``): codes [N' / 16, K / 32 * 256] with each block of 16
    features and 32 values as [v][feature][i] of GGUF's byte 4 v + i, scales and offsets [N' / 16, K / 32, 16];
    N' is N rounded up to 64, the extra features' codes, scales and offsets zero. Called once per layer at load."""
    n, half_k = codes.shape
    nb = half_k // (BLOCK // 2)
    padded = -(-n // Q4X16_ITEM) * Q4X16_ITEM

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(padded - n, *t.shape[1:])]) if padded > n else t

    blocks = pad(codes).view(padded // Q4X16_FEATURES, Q4X16_FEATURES, nb, 4, 4)  # [fb, f, b, v, i]
    packed = blocks.permute(0, 2, 3, 1, 4).contiguous().view(padded // Q4X16_FEATURES, nb * 256)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, nb] -> [fb, nb, 16]
        return pad(t).view(padded // Q4X16_FEATURES, Q4X16_FEATURES, nb).transpose(1, 2).contiguous()

    return packed, per_block(scales), per_block(mins)


def pack_i8x16(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 per-channel weights ([N, K] codes, [N] float32 scales) interleaved by 16 output features for
    ``i8x16_linear`` (``nanovllm/csrc/quant_gemm.cpp``): codes [N' / 16, K / 32 * 512] uint8 with each block of 16
    features and 32 values as [v][feature][i] of w[feature][4 v + i] + 128, scales [N'] float32; N' is N rounded
    up to 64, the extra features' codes 128 (zero weights) and scales 0. Called once per layer at load."""
    n = codes.shape[0]
    padded = -(-n // Q4X16_ITEM) * Q4X16_ITEM
    if padded > n:
        scales = torch.cat([scales, scales.new_zeros(padded - n)])
    return _interleave_int8(codes), scales.contiguous()


def pack_q8x16(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 blocks ([N, K] int8 codes, [N, K / 32] fp16 scales) interleaved by 16 output features for
    ``q8x16_linear``: the codes as ``pack_i8x16`` stores them, the scales as ``pack_q4x16`` does ([N' / 16, K / 32,
    16], the extra features' zero). Called once per layer at load."""
    n, nb = scales.shape
    padded = -(-n // Q4X16_ITEM) * Q4X16_ITEM
    if padded > n:
        scales = torch.cat([scales, scales.new_zeros(padded - n, nb)])
    return _interleave_int8(codes), scales.view(padded // Q4X16_FEATURES, Q4X16_FEATURES, nb).transpose(1, 2).contiguous()


def _interleave_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] as [N' / 16, K / 32 * 512] uint8: per block of 16 features and 32 values, [v][feature][i]
    of w[feature][4 v + i] + 128; N' is N rounded up to 64, the extra features' codes 128 (zero weights)."""
    n, k = codes.shape
    nb = k // BLOCK
    padded = -(-n // Q4X16_ITEM) * Q4X16_ITEM
    unsigned = (codes.to(torch.int16) + 128).to(torch.uint8)
    if padded > n:
        unsigned = torch.cat([unsigned, unsigned.new_full((padded - n, k), 128)])
    blocks = unsigned.view(padded // Q4X16_FEATURES, Q4X16_FEATURES, nb, 8, 4)  # [fb, f, b, v, i]
    return blocks.permute(0, 2, 3, 1, 4).contiguous().view(padded // Q4X16_FEATURES, nb * 512)


def _deinterleave_int8(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The int8 codes [len(ids), K] of features ``ids`` from ``_interleave_int8``'s layout."""
    nb = packed.shape[1] // 512
    fb, f = ids // Q4X16_FEATURES, ids % Q4X16_FEATURES
    unsigned = packed.view(packed.shape[0], nb, 8, Q4X16_FEATURES, 4)[fb, :, :, f, :]  # [rows, nb, v, i]
    return (unsigned.reshape(len(ids), nb * 32).to(torch.int16) - 128).to(torch.int8).contiguous()


def unpack_i8x16(packed: torch.Tensor, scales: torch.Tensor, n: int, rows: torch.Tensor | None = None):
    """The inverse of ``pack_i8x16`` for the first ``n`` features (or the features ``rows``): (codes, scales, None)."""
    ids = torch.arange(n) if rows is None else rows
    return _deinterleave_int8(packed, ids), scales[ids].contiguous(), None


def unpack_q8x16(packed: torch.Tensor, scales: torch.Tensor, n: int, rows: torch.Tensor | None = None):
    """The inverse of ``pack_q8x16`` for the first ``n`` features (or the features ``rows``): (codes, scales, None)."""
    ids = torch.arange(n) if rows is None else rows
    fb, f = ids // Q4X16_FEATURES, ids % Q4X16_FEATURES
    return _deinterleave_int8(packed, ids), scales[fb, :, f].contiguous(), None


def unpack_q4x16(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int,
                 rows: torch.Tensor | None = None):
    """The inverse of ``pack_q4x16`` for the first ``n`` features (or the features ``rows``)."""
    blocks = packed.shape[0]
    nb = scales.shape[1]
    ids = torch.arange(n) if rows is None else rows
    fb, f = ids // Q4X16_FEATURES, ids % Q4X16_FEATURES
    codes = packed.view(blocks, nb, 4, Q4X16_FEATURES, 4)[fb, :, :, f, :]  # [rows, nb, v, i]
    return (codes.reshape(len(ids), nb * 16).contiguous(), scales[fb, :, f].contiguous(), mins[fb, :, f].contiguous())


def _offsets(mins: torch.Tensor | None) -> torch.Tensor:
    """The offsets of a Q4 layer fused with others of its format (which all carry them)."""
    assert mins is not None
    return mins


def first_dtype(tensors: list[torch.Tensor | None]) -> torch.dtype:
    return next(t.dtype for t in tensors if t is not None)


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else bias.detach().to(dtype).contiguous()


def dequantize(fmt: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """float32 [N, K] of quantized codes in one of the kernel's formats."""
    if fmt == "int8":
        return qweight.float() * scales.float()[:, None]
    n = qweight.shape[0]
    if fmt == "q8_0":
        codes = qweight.float().reshape(n, -1, BLOCK)
    else:  # q4_0 / q4_1: per block of 16 bytes, low nibbles are elements 0..15, high nibbles 16..31
        packed = qweight.reshape(n, -1, BLOCK // 2)
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
    w = codes * scales.float().reshape(n, -1, 1)
    if mins is not None:
        w = w + mins.float().reshape(n, -1, 1)
    return w.reshape(n, -1)


class QuantEmbedding(nn.Module):
    """An embedding table kept in its GGUF blocks: the rows a step looks up are dequantized, nothing else."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        return dequantize(t.fmt, *t.canonical(ids)).to(self.dtype)
