"""The fast path's weight layouts: fused projections and oneDNN-prepacked weights.

The float32 reference path keeps transformers' separate q/k/v and gate/up projections (same GEMM shapes, so
bitwise-equal results). The fast path concatenates them into one GEMM each (fewer, larger matmuls: less
dispatch and better use of the weight stream), and on CPU in bfloat16 stores every linear weight in oneDNN's
blocked layout once at load time, so no matmul reorders its weight again on every call. Both are held to the
close standard (``python -m nanovllm.validate``), not the exact one.
"""

from __future__ import annotations

import torch
from torch import nn


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
    """oneDNN's prepacked bf16 linear exists on this CPU build for this weight."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """A bias-optional linear whose weight is stored in oneDNN's blocked layout (CPU, bfloat16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, batch_hint: int = 64) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The batch size only guides oneDNN's choice of layout; any number of rows runs.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def prepack(module: nn.Module, names: tuple[str, ...]) -> None:
    """Replace ``module.<name>`` linears by ``PackedLinear`` where the CPU supports it."""
    for name in names:
        linear = getattr(module, name)
        if isinstance(linear, nn.Linear) and can_prepack(linear.weight):
            setattr(module, name, PackedLinear(linear.weight, linear.bias))
