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

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

QUANTIZATIONS = ("int8", "gguf")
BLOCK = 32                                     # weights per GGUF block, activation values per scale
# The kernel's weight formats (QuantFormat in quant_gemm.cpp); Q4_0 runs as Q4_1 with offset m = -8 d.
FORMAT_IDS = {"int8": 0, "q8_0": 1, "q4_1": 2, "q4_0": 2}
GGUF_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")     # the quantized GGUF tensor types quantization="gguf" runs
GGUF_DENSE_TYPES = ("F32", "F16", "BF16")
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
    from nanovllm import machine

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
            biases = [b if b is not None else torch.zeros(p.out_features, dtype=first_dtype(biases))
                      for b, p in zip(biases, parts)]
            bias = torch.cat(biases)
        else:
            bias = None
        canonical = [p.canonical() for p in parts]
        mins = None if first.mins is None else torch.cat([c[2] for c in canonical])
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


# ---- GGUF -------------------------------------------------------------------------------------------------------

@dataclass
class GGUFTensor:
    name: str
    kind: str                  # GGML type name: Q4_1, F32, ...
    shape: tuple[int, ...]     # GGUF's order: the fastest-varying dimension (K of a weight) first
    data: np.ndarray           # its bytes in the file (memory-mapped, uint8), or the values of a dense type


# GGUF metadata value types (the GGUF spec) -> struct format; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_DENSE_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_gguf(path: Path) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
    """The scalar metadata and the tensors of a GGUF file, the tensors memory-mapped. Array metadata (the
    tokenizer's vocabulary: ~100k strings here) is skipped, not decoded: gguf-py's reader decodes every value
    and takes seconds on it, longer than building the whole model."""
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(raw)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"model={str(path)!r} is not a GGUF file")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    pos = 24

    def read(fmt: str):
        nonlocal pos
        value = struct.unpack_from("<" + fmt, buf, pos)[0]
        pos += struct.calcsize("<" + fmt)
        return value

    def read_string() -> str:
        nonlocal pos
        size = read("Q")
        pos += size
        return bytes(buf[pos - size:pos]).decode("utf-8", "replace")

    def skip_value(kind: int) -> object:
        nonlocal pos
        if kind == 8:
            return read_string()
        if kind == 9:
            element, count = read("I"), read("Q")
            if element in _SCALARS:
                pos += count * struct.calcsize("<" + _SCALARS[element])
            else:
                for _ in range(count):
                    skip_value(element)
            return None
        return read(_SCALARS[kind])

    metadata: dict[str, object] = {}
    for _ in range(num_kv):
        key = read_string()
        metadata[key] = skip_value(read("I"))
    infos = []
    for _ in range(num_tensors):
        name = read_string()
        dims = tuple(read("Q") for _ in range(read("I")))
        infos.append((name, dims, GGMLQuantizationType(read("I")), read("Q")))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-pos // alignment) * alignment
    tensors = {}
    for name, dims, qtype, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims))
        data = raw[start + offset:start + offset + count // block * block_bytes]
        if qtype.name in _DENSE_NUMPY:
            data = data.view(_DENSE_NUMPY[qtype.name])
        tensors[name] = GGUFTensor(name, qtype.name, dims, data)
    del version
    return metadata, tensors


# The tensors of a Llama-family GGUF that run as matmuls (build_gguf_model's linears), per decoder block.
_GGUF_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def gguf_head_name(tensors) -> str:
    """The tensor a GGUF model's LM head runs: ``output.weight``, or the embedding it is tied to."""
    return "output.weight" if "output.weight" in tensors else "token_embd.weight"


def gguf_stored_bytes(path: Path) -> tuple[int, int, int]:
    """(bytes, weights) of the matmul weights a forward pass over ``path``'s blocks streams -- the decoder
    layers' linears and the LM head (``output``, or the tied ``token_embd``), as the file stores them -- and the
    bytes of all its tensors: what ``quantization="gguf"`` holds in memory, read from the header alone. The
    simulator's cost model of a GGUF run (``ModelCost.from_hf_config``) takes them; a built model's own count
    (``LlamaForCausalLM.streamed_weights``) agrees."""
    _, tensors = read_gguf(path)
    head = gguf_head_name(tensors)
    matmuls = [tensor for name, tensor in tensors.items()
               if name == head or (name.startswith("blk.") and name.split(".")[-2] in _GGUF_LINEARS)]
    if not matmuls or head not in tensors:
        raise ValueError(f"{Path(path).name} has no Llama-family linears (blk.N.attn_q.weight, ...) and LM head")
    return (sum(t.data.nbytes for t in matmuls), sum(int(np.prod(t.shape)) for t in matmuls),
            sum(t.data.nbytes for t in tensors.values()))


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
