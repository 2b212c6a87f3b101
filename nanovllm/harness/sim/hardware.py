"""Hardware descriptions for the analytical step-time model (the Hydra group ``hardware=``).

A description gives peak FLOP/s per dtype (``int8``: operations a second, what quantized linears run at),
memory bandwidth and size, how much of the peaks real kernels reach, and a fixed per-step overhead (scheduling,
launches, sampling). The KV cache gets what ``memory_fraction`` of
memory leaves after the weights, as a serving engine sizes it on a GPU.

``kv_tier_links``: the links K/V blocks cross to and from the KV tiers below the pool (``kv_offload``), by tier
name: ``host`` (host memory over PCIe), ``disk`` (NVMe), ``shared`` (the cluster's shared store over RDMA or
Ethernet); each ``{bandwidth: bytes/s, latency: s}``. The simulated runner charges every step the time of
what moved (``nanovllm.engine.sim_runner.tier_seconds``).

``tp_link_bandwidth`` / ``tp_link_latency``: the link between the GPUs of one replica under tensor parallelism
(``engine.tensor_parallel_size`` > 1: NVLink within a node), what a ring all-reduce achieves per GPU (bytes/s)
and its fixed cost per collective (seconds). A replica of N GPUs has N times the memory for weights and KV
cache (``kv_cache_bytes``), and the step-time models split each step's work over the N and add its all-reduces
(``nanovllm.harness.sim.step_time.tensor_parallel_seconds``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping


@dataclass
class Hardware:
    """One accelerator (or CPU). Peaks from its public spec sheet; efficiencies fitted to measured operator timings
    where its yaml says so (``nanovllm.harness.sim.fit_hardware``), else assumptions."""

    name: str = "unnamed"
    peak_flops: dict[str, float] = field(default_factory=dict)  # dtype name -> dense FLOP/s
    memory_bandwidth: float = 0.0       # bytes/s
    memory_bytes: float = 0.0           # device memory
    memory_fraction: float = 0.9        # of memory the engine may use (weights + KV cache)
    flops_efficiency: float = 0.6       # fraction of peak FLOP/s that real matmuls reach
    bandwidth_efficiency: float = 0.8   # fraction of peak bandwidth that real kernels reach
    step_overhead: float = 0.0          # seconds per step regardless of the batch
    # Prefill/decode disaggregation: the link K/V cross between a prefill and a decode replica (bytes/s, s);
    # a simulated cluster uses it when kv_transfer names no bandwidth of its own.
    kv_link_bandwidth: float | None = None
    kv_link_latency: float | None = None
    # KV tiers: tier name -> {bandwidth: bytes/s, latency: s} (see the module docstring).
    kv_tier_links: dict[str, dict[str, float]] = field(default_factory=dict)
    # Tensor parallelism inside a replica: the GPU-to-GPU link's all-reduce bandwidth (bytes/s a GPU) and latency.
    tp_link_bandwidth: float | None = None
    tp_link_latency: float = 0.0

    def __post_init__(self) -> None:
        self.kv_tier_links = check_kv_tier_links(self.kv_tier_links)
        for key in ("memory_bandwidth", "memory_bytes"):
            if not _positive(getattr(self, key)):
                raise ValueError(f"hardware.{key} must be > 0, got {getattr(self, key)!r}")
        if not self.peak_flops or not all(_positive(v) for v in self.peak_flops.values()):
            raise ValueError(f"hardware.peak_flops must map dtype names to FLOP/s > 0, got {self.peak_flops!r}")
        for key in ("memory_fraction", "flops_efficiency", "bandwidth_efficiency"):
            value = getattr(self, key)
            if not (_positive(value) and value <= 1):
                raise ValueError(f"hardware.{key} must be in (0, 1], got {value!r}")
        if not (isinstance(self.step_overhead, (int, float)) and self.step_overhead >= 0):
            raise ValueError(f"hardware.step_overhead must be >= 0 seconds, got {self.step_overhead!r}")
        if self.tp_link_bandwidth is not None and not _positive(self.tp_link_bandwidth):
            raise ValueError(f"hardware.tp_link_bandwidth must be > 0 bytes/s, got {self.tp_link_bandwidth!r}")
        if not (isinstance(self.tp_link_latency, (int, float)) and self.tp_link_latency >= 0):
            raise ValueError(f"hardware.tp_link_latency must be >= 0 seconds, got {self.tp_link_latency!r}")

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | None) -> "Hardware":
        """From a ``hardware=`` config node; unknown keys are an error naming them."""
        if node is None:
            raise ValueError("hardware is not set; the analytical step-time model needs one, e.g. hardware=h100_sxm")
        data = dict(node)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"hardware: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        peak_flops = data.get("peak_flops") or {}
        if not isinstance(peak_flops, Mapping) or not all(_positive(v) for v in peak_flops.values()):
            raise ValueError("hardware.peak_flops must map dtype names to FLOP/s > 0, e.g. "
                             f"{{bfloat16: 989.4e12}}, got {peak_flops!r}")
        data["peak_flops"] = {str(k): float(v) for k, v in peak_flops.items()}
        return cls(**data)

    def peak_flops_for(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"hardware.peak_flops has no entry for dtype {dtype!r} (has: "
                             f"{', '.join(sorted(self.peak_flops))}); add one or choose engine.dtype among them")
        return self.peak_flops[dtype]

    def matmul_peak_flops(self, dtype: str, int8_matmuls: bool) -> float:
        """The peak the linears run against: ``int8``'s where they multiply in int8 (``ModelCost.int8_matmuls``:
        ``engine.quantization`` int8 or gguf), else ``dtype``'s."""
        if not int8_matmuls:
            return self.peak_flops_for(dtype)
        if "int8" not in self.peak_flops:
            raise ValueError(f"hardware.peak_flops has no int8 entry (has: {', '.join(sorted(self.peak_flops))}), "
                             "and engine.quantization multiplies the linears in int8: add hardware.peak_flops.int8 "
                             "(int8 operations a second) or set engine.quantization=null")
        return self.peak_flops["int8"]

    def kv_cache_bytes(self, weight_bytes: float, num_gpus: int = 1) -> int:
        """Memory left for the KV cache once the weights are in, over the ``num_gpus`` a tensor-parallel replica
        spans (each holds 1/N of the weights and of every block's K/V heads); an error naming the field when none
        is."""
        usable = self.memory_bytes * self.memory_fraction * num_gpus
        if usable <= weight_bytes:
            gpus = f"{num_gpus} x " if num_gpus > 1 else ""
            hint = "" if num_gpus > 1 else "; split it over GPUs with engine.tensor_parallel_size"
            raise ValueError(
                f"hardware.memory_bytes: {gpus}{self.name} has {usable / 2**30:.1f} GiB usable "
                f"(memory_bytes x memory_fraction) but the model's weights need {weight_bytes / 2**30:.1f} GiB{hint}"
            )
        return int(usable - weight_bytes)


def check_kv_tier_links(links: Any) -> dict[str, dict[str, float]]:
    """``hardware.kv_tier_links`` as ``{tier: {"bandwidth": bytes/s > 0, "latency": s >= 0}}``; an error naming
    the entry otherwise."""
    if links is None:
        return {}
    if not isinstance(links, Mapping):
        raise ValueError(f"hardware.kv_tier_links must map tier names to {{bandwidth, latency}}, got {links!r}")
    checked = {}
    for tier, link in links.items():
        if not isinstance(link, Mapping) or set(link) - {"bandwidth", "latency"}:
            raise ValueError(f"hardware.kv_tier_links.{tier} must be {{bandwidth: bytes/s, latency: s}}, got {link!r}")
        bandwidth, latency = link.get("bandwidth"), link.get("latency", 0.0)
        if not _positive(bandwidth):
            raise ValueError(f"hardware.kv_tier_links.{tier}.bandwidth must be > 0 bytes/s, got {bandwidth!r}")
        if not (isinstance(latency, (int, float)) and not isinstance(latency, bool) and latency >= 0):
            raise ValueError(f"hardware.kv_tier_links.{tier}.latency must be >= 0 seconds, got {latency!r}")
        checked[str(tier)] = {"bandwidth": float(bandwidth), "latency": float(latency)}
    return checked


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
