"""The fast path's weight layouts: fused projections and oneDNN-prepacked weights.

The float32 reference path keeps transformers' separate q/k/v and gate/up projections (same GEMM shapes, so
bitwise-equal results). The fast path concatenates them into one GEMM each (fewer, larger matmuls: less
dispatch and better use of the weight stream), and on CPU (bfloat16 and float32) stores every linear weight in
oneDNN's blocked layout once at load time, so no matmul reorders its weight again on every call. In float32 the
prepacked GEMM is 1.1-2.4x faster than ``F.linear`` for this model's shapes at every row count from 1 to 1,583
(one thread, the layers of one decoder block, with and without the LM head), as ``F.linear``'s fp32 path is a
generic BLAS call that re-blocks the weight each time. Both are held to the
close standard (``python -m nanovllm.validate``), not the exact one.
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.models.quantized import QuantLinear


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


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked linear exists on this CPU build for this weight (float32, or bfloat16 where the CPU
    has it)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


class PackedLinear(nn.Module):
    """A bias-optional linear whose weight is stored in oneDNN's blocked layout (CPU, bfloat16 or float32).

    In bfloat16, inputs of at most ``GEMV_MAX_ROWS`` rows (a decode step of one or two sequences) go instead through
    nano-vllm's bf16 GEMV kernel (``nanovllm/csrc/gemv.cpp``) on the plain weight, kept for that purpose: with so
    few rows the layer is one pass over its weights, and oneDNN's blocked GEMM reads them slower than the
    kernel (measured one thread, SmolLM2's 186 layer shapes: 1 row 27.3 -> 23.6 ms, 2 rows 28.8 -> 21.3 ms;
    at 4 rows oneDNN is ahead again).
    """

    GEMV_MAX_ROWS = 2

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, batch_hint: int = 64,
                 kernels=None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The batch size only guides oneDNN's choice of layout; any number of rows runs.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.bias = None if bias is None else bias.detach().clone()
        # The GEMV kernel is bf16-only; in float32 oneDNN's packed GEMM beats F.linear even at one row.
        use_gemv = kernels is not None and weight.dtype == torch.bfloat16 and kernels.gemv_available()
        self.kernels = kernels if use_gemv else None
        self.weight = weight.detach().contiguous() if use_gemv else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2 and x.shape[0] <= self.GEMV_MAX_ROWS:
            # Through the dispatcher (registered by the kernels' library) so profiles count it as a linear.
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
            setattr(module, name, QuantLinear.from_dense_int8(linear.weight, linear.bias, kernels))
        elif can_prepack(linear.weight):
            setattr(module, name, PackedLinear(linear.weight, linear.bias, kernels=kernels))
