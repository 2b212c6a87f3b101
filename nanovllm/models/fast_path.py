"""The fast path's weight layouts: fused projections and prepacked weights.

The float32 reference path keeps transformers' separate q/k/v and gate/up projections (same GEMM shapes, so
bitwise-equal results). The fast path concatenates them into one GEMM each (fewer, larger matmuls: less
dispatch and better use of the weight stream), and on CPU stores every linear weight once at load time in the
layout its kernel reads, so no matmul reorders its weight again on every call. Which kernel (``linear_kernel``):

- ``brgemm``: nano-vllm's loop over oneDNN's brgemm micro-kernel (``nanovllm/csrc/brgemm_linear.cpp``), for
  float32 on every x86 SIMD level and for bfloat16 on AMX (its tiles). One stored copy serves every row count.
  It is ahead of oneDNN's prepacked linear (the next kernel) at decode row counts and level or behind at
  prefill-sized ones (``experiments/bench_linears.py``; docs/speed.md has the measurement and its machine). One
  copy per weight, so no switch by row count: the whole-run benchmarks decide.
- ``onednn+gemv``: bfloat16 without AMX (AVX-512 BF16): oneDNN's prepacked linear, and nano-vllm's bf16 GEMV for
  at most ``PackedLinear.GEMV_MAX_ROWS`` rows.
- ``bf16-fma``: bfloat16 on AVX2 (no AVX-512): nano-vllm's kernel (``nanovllm/csrc/bf16_fma_linear.cpp``), bf16
  weights widened to float32 in registers and multiplied with float32 FMAs. oneDNN has no bf16 GEMM below
  AVX-512, and ATen's own bf16 matmul, what ran before, is slower at one row and several times slower from a few
  rows on (``experiments/bench_linears.py --dtypes bfloat16``; docs/speed.md has the measurement).
- ``onednn``: oneDNN's prepacked linear at every row count (bfloat16 on AVX-512 without BF16, float32 on the
  scalar level).

Both dtypes are held to the close standard (``python -m nanovllm.validate``), not the exact one.
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm import machine
from nanovllm.models.quantized import INT8_ACTIVATION_DIGITS, QuantLinear


def fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the concatenation of ``linears``' outputs (same input)."""
    first = linears[0]
    out_features = sum(layer.out_features for layer in linears)
    has_bias = first.bias is not None
    fused = nn.Linear(first.in_features, out_features, bias=has_bias, dtype=first.weight.dtype,
                      device=first.weight.device)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([layer.weight for layer in linears]))
        if has_bias:
            fused.bias.copy_(torch.cat([layer.bias for layer in linears]))
    return fused.requires_grad_(False)


def can_prepack(weight: torch.Tensor, kernels=None) -> bool:
    """A ``PackedLinear`` can hold this weight: oneDNN's prepacked linear exists on this CPU build for it (float32,
    or bfloat16 where oneDNN has bf16), or, with the compiled ``kernels``, it is bfloat16 at the level where
    ``linear_kernel`` picks nano-vllm's ``bf16-fma``."""
    if weight.device.type != "cpu":
        return False
    if (weight.dtype == torch.bfloat16 and kernels is not None and linear_kernel(weight.dtype) == "bf16-fma"
            and kernels.bf16_fma_available()):
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


# The ISA levels on which the float32 linears run the brgemm kernel: every x86 SIMD level (oneDNN JIT-compiles
# the micro-kernel for each); the scalar level caps oneDNN below its JIT kernels.
BRGEMM_FLOAT32_LEVELS = ("amx", "avx512_bf16", "avx512", "avx2")


def linear_kernel(dtype: torch.dtype, isa: str | None = None) -> str:
    """The kernel a fast-path CPU linear of ``dtype`` runs at ISA level ``isa`` (None: the level in force):
    ``brgemm``, ``onednn+gemv``, ``bf16-fma`` or ``onednn`` (this module's docstring says why each)."""
    isa = machine.selected_isa() if isa is None else isa
    if dtype == torch.bfloat16:
        if isa == "amx":
            return "brgemm"
        if isa == "avx2":
            return "bf16-fma"
        return "onednn+gemv" if isa == "avx512_bf16" else "onednn"
    return "brgemm" if isa in BRGEMM_FLOAT32_LEVELS else "onednn"


# Output features per block of each kernel's stored weight (brgemm_linear.cpp's BLOCK_N, bf16_fma_linear.cpp's
# kFeatures): the weight is padded with zero features to whole blocks. oneDNN's layouts hold N x K.
PACKED_FEATURES = {"brgemm": 32, "bf16-fma": 16, "onednn+gemv": 1, "onednn": 1}


def linear_weight_bytes(kernel: str, out_features: int, in_features: int, dtype: torch.dtype) -> int:
    """Bytes of weight a ``PackedLinear`` of ``kernel`` stores and a forward pass reads (``num_bytes``): N padded
    to the kernel's blocks of features times K, at ``dtype``'s size. Pure, so the cost model and tests can ask it
    for any CPU's kernel."""
    block = PACKED_FEATURES[kernel]
    return -(-out_features // block) * block * in_features * torch.finfo(dtype).bits // 8


class PackedLinear(nn.Module):
    """A bias-optional CPU linear (bfloat16 or float32) whose weight is stored once in its kernel's layout; the
    kernel is ``linear_kernel(dtype)`` when the compiled ``kernels`` are given, else oneDNN's prepacked linear.

    With ``onednn+gemv``, inputs of at most ``GEMV_MAX_ROWS`` rows (a decode step of one or two sequences) go
    through nano-vllm's bf16 GEMV kernel (``nanovllm/csrc/gemv.cpp``) on the plain weight, kept for that purpose:
    with so few rows the layer is one pass over its weights, and oneDNN's blocked GEMM reads them slower than the
    kernel does; from 4 rows on oneDNN is ahead again (``experiments/bench_linears.py`` times both).
    """

    GEMV_MAX_ROWS = 2

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, batch_hint: int = 64,
                 kernels=None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        kernel = linear_kernel(weight.dtype) if kernels is not None else "onednn"
        if kernel == "brgemm" and weight.dtype == torch.bfloat16 and self.in_features % 2:
            kernel = "onednn"  # AMX multiplies bf16 in pairs along K
        if kernel == "onednn+gemv" and not kernels.gemv_available():
            kernel = "onednn"
        self.kernel = kernel
        self.kernels = kernels  # the C++ decoder stack calls this layer's kernel through them, oneDNN's too
        self.weight: torch.Tensor | None = None
        if kernel in ("brgemm", "bf16-fma"):
            pack = kernels.pack_brgemm_weight if kernel == "brgemm" else kernels.pack_bf16_fma_weight
            self.packed = pack(weight)
            # float32 once here, not per call: both kernels add the bias to their float32 sums.
            self.bias = None if bias is None else bias.detach().float().contiguous()
            return
        # The batch size only guides oneDNN's choice of layout; any number of rows runs.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if bias is None else bias.detach().clone()
        if kernel == "onednn+gemv":
            self.weight = weight.contiguous()

    @property
    def num_bytes(self) -> int:
        """Bytes of weight data a forward pass reads: the packed layout's, or the plain copy the GEMV reads at 1-2
        rows where the layer keeps one (the same weights; only the layout differs)."""
        weight = self.weight if self.weight is not None else self.packed
        return weight.numel() * weight.element_size()

    def stack_linear(self):
        """This layer as the C++ decoder stack runs it (``kernels.stack_linear``: the same kernel calls as
        ``forward``), or None without the compiled kernels. Called once, when the model builds its stack."""
        if self.kernels is None:
            return None
        if self.kernel in ("brgemm", "bf16-fma"):
            return self.kernels.stack_linear(self.kernel, self.packed, None, None, self.bias, self.out_features)
        return self.kernels.stack_linear(self.kernel, self.packed, None, None, self.bias, self.out_features,
                                         gemv_weight=self.weight, gemv_max_rows=self.GEMV_MAX_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel in ("brgemm", "bf16-fma"):
            # Through the dispatcher (registered by the kernels' library) so profiles count it as a linear.
            rows = x.reshape(-1, self.in_features)
            op = self.kernels.brgemm_linear_op if self.kernel == "brgemm" else self.kernels.bf16_fma_linear_op
            out = op(rows, self.packed, self.bias, self.out_features)
            return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)
        if self.kernel == "onednn+gemv" and x.dim() == 2 and x.shape[0] <= self.GEMV_MAX_ROWS:
            return self.kernels.gemv_bf16_op(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def prepack(module: nn.Module, names: tuple[str, ...], kernels=None, quantization: str | None = None) -> None:
    """Replace ``module.<name>`` linears by ``PackedLinear`` where the CPU supports it (``kernels``: the compiled
    CPU kernels, for the few-row GEMV; None leaves every row count to oneDNN), or, with ``quantization="int8"``,
    by int8 ``QuantLinear``s (W8A8, ``nanovllm.models.quantized``)."""
    for name in names:
        linear = getattr(module, name)
        if not isinstance(linear, nn.Linear):
            continue
        if quantization == "int8":
            setattr(module, name, QuantLinear.from_dense_int8(linear.weight, linear.bias, kernels,
                                                              INT8_ACTIVATION_DIGITS.get(name, 2)))
        elif can_prepack(linear.weight, kernels):
            setattr(module, name, PackedLinear(linear.weight, linear.bias, kernels=kernels))
