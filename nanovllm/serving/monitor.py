"""How hard a run drives the hardware: model FLOPs utilisation (MFU) and memory-bandwidth utilisation (MBU).

Both come from a step record alone (``nanovllm.serving.records.StepRecord``) and a cost model of the network, so they
can be computed live by the engine or long after from ``steps.jsonl``:

* FLOPs per step = dense matmuls on every computed token + the LM head on sampled rows only + attention
  scores and values on the (query, key) pairs actually attended.
* Bytes per step = every weight read once, as stored (int8 codes or GGUF blocks with their scales for a
  quantized model) + the KV cache read for every scheduled context + the new KV written.

Decode is usually bandwidth bound (high MBU, tiny MFU) and prefill compute bound, which is why both are kept.
The peaks they are divided by come from config or from a short calibration on the device itself: a matmul
for FLOP/s (an int8 one where the linears multiply in int8), a large copy for bytes/s. Calibrated peaks are what
this machine reaches with torch, not the data sheet, so MFU near 1 means "as fast as torch matmul gets here".
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from nanovllm.attention.kv_quant import row_elements, storage_dtype
from nanovllm.config import attention_biases, head_dim_of
from nanovllm.outputs import StepColumns

_MIB = 1 << 20


@dataclass
class ModelCost:
    """Parameter counts and per-token sizes of a Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    bytes_per_element: int
    qkv_bias: bool = False      # Qwen2 always, Llama/Qwen3 when attention_bias
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False       # Qwen3 normalises q and k per head
    kv_cache_dtype: str = "auto"  # auto: K/V in the weights' dtype; int8 / fp8_e4m3: 1 byte + a scale per row
    # Bytes a matmul weight takes as stored, where that is not bytes_per_element: quantized weights (int8 codes
    # and their scales ~1, the default GGUF's Q4_1 and Q8_0 blocks ~0.7). None: dense, bytes_per_element.
    bytes_per_weight: float | None = None
    int8_matmuls: bool = False  # quantized linears multiply in int8 (W8A8, GGUF blocks): MFU against int8's peak
    # Memory all the weights take (the embedding and norms too), where ``weight_memory_bytes``' rule does not
    # give it: a GGUF file's blocks as stored. None: the rule.
    resident_bytes: int | None = None

    @classmethod
    def from_model(cls, model: Any, kv_cache_dtype: str = "auto") -> "ModelCost":
        """The cost of a built model: sizes from its config, biases and q/k norms from the parameters it
        really has, bytes per element from its weights' dtype, KV bytes from ``kv_cache_dtype`` (the engine's
        ``EngineConfig.kv_cache_dtype``). What the engine runs is what is counted."""
        names = [name for name, _ in model.named_parameters()]

        def has(*suffixes: str) -> bool:
            return any(name.endswith(suffix) for name in names for suffix in suffixes)

        dtype = next(model.parameters()).dtype
        # The bytes the model really streams per weight, where they are not the dtype's: quantized weights (its
        # first parameter, the embedding, is still in the model dtype), and packed layouts padded to whole blocks
        # of features (the kernel dispatched on this CPU decides: fast_path.linear_weight_bytes); int8 arithmetic.
        from nanovllm.models.quantized import QuantEmbedding, QuantLinear  # the model package pulls transformers

        int8_matmuls = any(isinstance(m, QuantLinear) for m in model.linear_layers() + model.lm_head_layers())
        nbytes, weights = model.streamed_weights()
        as_dtype = weights * dtype.itemsize
        bytes_per_weight = nbytes / weights if weights and (int8_matmuls or nbytes != as_dtype) else None
        cost = dataclasses.replace(
            cls.from_hf_config(model.config, dtype, kv_cache_dtype),
            qkv_bias=has("q_proj.bias", "qkv_proj.bias"), o_bias=has("o_proj.bias"),
            mlp_bias=has("gate_proj.bias", "gate_up_proj.bias", "down_proj.bias"), qk_norm=has("q_norm.weight"),
            bytes_per_weight=bytes_per_weight, int8_matmuls=int8_matmuls,
        )
        embedding = model.embed_tokens
        if isinstance(embedding, QuantEmbedding):  # GGUF: the table in its blocks, often the LM head's own
            shared = any(embedding.table is head for head in model.lm_head_layers())
            table = 0 if shared else embedding.table.num_bytes
            cost.resident_bytes = nbytes + table + cost.norm_params * cost.bytes_per_element
        return cost

    @classmethod
    def from_hf_config(cls, config: Any, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                       quantization: str | None = None, model: str | None = None) -> "ModelCost":
        """Build from a transformers config alone (a model that is not built: the simulator, an analytical
        estimate); ``dtype`` is the dtype weights are held in, and the KV cache too unless ``kv_cache_dtype``
        names an 8-bit one. Biases follow the same rule the model builder uses
        (``nanovllm.config.attention_biases``). ``quantization`` (``EngineConfig.quantization``) stores the
        linears and LM head as that engine does: ``"int8"`` one byte a weight and a float32 scale per output
        channel, the embedding and norms in ``dtype``; ``"gguf"`` the blocks of ``model``'s GGUF file
        (``nanovllm.models.loader.gguf_source``; None: the default model's), read from its header."""
        dense = cls._dense_from_hf_config(config, dtype, kv_cache_dtype)
        if quantization is None:
            return dense
        if quantization == "int8":
            # Every linear and the LM head: N x K codes and N float32 scales (W8A8 per output channel).
            weights = dense.linear_params + dense.lm_head_params
            stored = weights + 4 * dense.matmul_output_channels
            return dataclasses.replace(dense, bytes_per_weight=stored / weights, int8_matmuls=True)
        if quantization == "gguf":
            # The model package (transformers) only for a GGUF estimate: the cost model itself stays light.
            from nanovllm.models.gguf_reader import gguf_stored_bytes
            from nanovllm.models.loader import gguf_source

            matmul_bytes, matmul_weights, all_bytes = gguf_stored_bytes(gguf_source(model))
            return dataclasses.replace(dense, bytes_per_weight=matmul_bytes / matmul_weights, int8_matmuls=True,
                                       resident_bytes=all_bytes)
        raise ValueError(f"quantization must be None, 'int8' or 'gguf', got {quantization!r}")

    @classmethod
    def _dense_from_hf_config(cls, config: Any, dtype: torch.dtype, kv_cache_dtype: str) -> "ModelCost":
        num_heads = config.num_attention_heads
        head_dim = head_dim_of(config)
        qkv_bias, o_bias = attention_biases(config)
        model_type = getattr(config, "model_type", "")
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            bytes_per_element=torch.empty((), dtype=dtype).element_size(),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            kv_cache_dtype=kv_cache_dtype,
        )

    # -- parameter counts ---------------------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(input features, output features)`` of each matmul of a decoder layer, fused as a serving engine runs
        them and named as Vidur's operator profiles name them: q, k, v (``attn_pre_proj``; GQA: k and v are
        ``num_kv_heads`` wide), o (``attn_post_proj``), gate and up (``mlp_up_proj``, SwiGLU), down
        (``mlp_down_proj``). The parameter counts below and the per-operator costs (``layer_operator_costs``)
        both come from these shapes."""
        h, i = self.hidden_size, self.intermediate_size
        return {"attn_pre_proj": (h, self.q_size + 2 * self.kv_size), "attn_post_proj": (self.q_size, h),
                "mlp_up_proj": (h, 2 * i), "mlp_down_proj": (i, h)}

    @property
    def attention_params_per_layer(self) -> int:
        """q, k, v, o projections (GQA: k and v are ``num_kv_heads`` wide), biases included."""
        shapes = self.layer_linear_shapes
        params = sum(n_in * n_out for n_in, n_out in (shapes["attn_pre_proj"], shapes["attn_post_proj"]))
        if self.qkv_bias:
            params += self.q_size + 2 * self.kv_size
        if self.o_bias:
            params += self.hidden_size
        return params

    @property
    def mlp_params_per_layer(self) -> int:
        """gate, up and down projections of the SwiGLU MLP."""
        shapes = self.layer_linear_shapes
        params = sum(n_in * n_out for n_in, n_out in (shapes["mlp_up_proj"], shapes["mlp_down_proj"]))
        if self.mlp_bias:
            params += 2 * self.intermediate_size + self.hidden_size
        return params

    @property
    def linear_params_per_layer(self) -> int:
        return self.attention_params_per_layer + self.mlp_params_per_layer

    @functools.cached_property   # read by every step's cost; the fields are set once, at construction
    def linear_params(self) -> int:
        """Non-embedding linear parameters over all decoder layers (the LM head is counted separately)."""
        return self.num_layers * self.linear_params_per_layer

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def matmul_output_channels(self) -> int:
        """Output features of every linear and the LM head (an int8 weight's float32 scales, one each)."""
        per_layer = self.q_size + 2 * self.kv_size + 2 * self.hidden_size + 2 * self.intermediate_size
        return self.num_layers * per_layer + self.vocab_size

    @property
    def norm_params(self) -> int:
        per_layer = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return self.num_layers * per_layer + self.hidden_size

    @property
    def total_params(self) -> int:
        """All parameters as transformers counts them (a tied LM head shares the embedding)."""
        embedding = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else self.lm_head_params
        return self.linear_params + self.norm_params + embedding + lm_head

    @functools.cached_property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, as the cache stores them: in the weights' dtype, or (8-bit
        caches) one byte per value plus a float32 scale per KV head (``nanovllm.attention.kv_quant``)."""
        if self.kv_cache_dtype == "auto":
            return 2 * self.num_layers * self.kv_size * self.bytes_per_element
        element = torch.empty((), dtype=storage_dtype(self.kv_cache_dtype, torch.float32)).element_size()
        return 2 * self.num_layers * self.num_kv_heads * row_elements(self.head_dim, self.kv_cache_dtype) * element

    @functools.cached_property
    def weight_bytes(self) -> int:
        """What one forward pass streams from memory: every linear weight plus the LM head, as stored (quantized
        weights: ``bytes_per_weight``). The embedding lookup touches only the rows of the batch's tokens, so it is
        left out."""
        per_weight = self.bytes_per_weight if self.bytes_per_weight is not None else self.bytes_per_element
        return round((self.linear_params + self.lm_head_params) * per_weight)

    @property
    def weight_memory_bytes(self) -> int:
        """Memory all the weights take, what a serving engine sizes its KV cache around (the simulator's
        ``hardware=`` runs): ``total_params`` in the model dtype when dense; quantized, the linears and LM head
        as stored (``weight_bytes``) beside the embedding table and norms in the model dtype (int8 keeps a
        dense embedding for the lookup even when the head is tied to it), or ``resident_bytes`` where set (a
        GGUF file's blocks)."""
        if self.resident_bytes is not None:
            return self.resident_bytes
        if self.bytes_per_weight is None:
            return self.total_params * self.bytes_per_element
        return self.weight_bytes + (self.vocab_size * self.hidden_size + self.norm_params) * self.bytes_per_element

    # -- per-operator cost ----------------------------------------------------------------------------------

    def layer_operator_costs(self, tokens: Any) -> dict[str, tuple[Any, Any]]:
        """``(FLOPs, bytes)`` of each kernel of one decoder layer over ``tokens`` rows (an int or a numpy array of
        them), by Vidur's operator names, for comparing the roofline with per-operator GPU timings
        (``nanovllm.harness.sim.fit_hardware``). Matmuls (``layer_linear_shapes``): 2 FLOPs per multiply-add,
        the weight read once as stored plus the rows' inputs and outputs. Elementwise kernels: bytes only (they
        are bandwidth bound), each tensor read or written once -- RMSNorms read and write the hidden state and
        read their weight, RoPE reads and writes q and k, the SwiGLU activation reads gate and up and writes
        their product, the residual add reads two hidden states and writes one. The embedding gather and
        attention are not here (not layer operators of this kind)."""
        per_weight = self.bytes_per_weight if self.bytes_per_weight is not None else self.bytes_per_element
        element = self.bytes_per_element
        h = self.hidden_size
        costs: dict[str, tuple[Any, Any]] = {}
        for op, (n_in, n_out) in self.layer_linear_shapes.items():
            costs[op] = (2 * n_in * n_out * tokens, n_in * n_out * per_weight + (n_in + n_out) * tokens * element)
        norm = (0 * tokens, (2 * h * tokens + h) * element)
        costs["input_layernorm"] = costs["post_attention_layernorm"] = norm
        costs["attn_rope"] = (0 * tokens, 2 * (self.q_size + self.kv_size) * tokens * element)
        costs["mlp_act"] = (0 * tokens, 3 * self.intermediate_size * tokens * element)
        costs["add"] = (0 * tokens, 3 * h * tokens * element)
        return costs

    # -- per-step cost --------------------------------------------------------------------------------------

    def step_flops(self, step: Mapping[str, Any]) -> float:
        """Floating-point operations of one engine step (multiply-add = 2 FLOPs)."""
        return self.step_matmul_flops(step) + self.step_attention_flops(step)

    def step_matmul_flops(self, step: Mapping[str, Any]) -> float:
        """The linears' and LM head's share of ``step_flops``: the products that run in int8 where
        ``int8_matmuls``."""
        return float(self.step_matmul_work(step))

    def step_attention_flops(self, step: Mapping[str, Any]) -> float:
        """Attention's share of ``step_flops`` (always in the model dtype): QK^T and PV, 2 FLOPs each per
        (query, key) pair per head dimension, in every head and layer."""
        return float(self.step_attention_work(step))

    def step_bytes(self, step: Mapping[str, Any]) -> float:
        """Bytes moved to/from device memory by one step: weights once, KV cache read, new KV written."""
        return float(self.step_bytes_work(step))

    # The three figures above before their conversion to float: for a step's numbers or, element-wise, for
    # arrays of many steps' (``Monitor.annotate_columns``).
    def step_matmul_work(self, step: Mapping[str, Any]) -> Any:
        tokens = step["num_prefill_tokens"] + step["num_decode_tokens"]
        dense = 2 * self.linear_params * tokens
        # Logits are computed only for the rows that sample a token, not for every prompt token.
        lm_head = 2 * self.hidden_size * self.vocab_size * step["num_sampled"]
        return dense + lm_head

    def step_attention_work(self, step: Mapping[str, Any]) -> Any:
        return 4 * step["attn_pairs"] * self.num_heads * self.head_dim * self.num_layers

    def step_bytes_work(self, step: Mapping[str, Any]) -> Any:
        tokens = step["num_prefill_tokens"] + step["num_decode_tokens"]
        kv_read = step["context_tokens"] * self.kv_bytes_per_token
        kv_written = tokens * self.kv_bytes_per_token
        return self.weight_bytes + kv_read + kv_written


@dataclass
class MonitorConfig:
    """Peak FLOP/s and bytes/s to divide by. A value left ``None`` is measured when ``calibrate`` is true;
    with ``calibrate=False`` it stays unknown and the matching utilisation is reported as ``None``."""

    peak_flops: float | None = None
    peak_bandwidth: float | None = None
    calibrate: bool = True

    def __post_init__(self) -> None:
        for key in ("peak_flops", "peak_bandwidth"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not value > 0):
                raise ValueError(f"monitor.{key} must be > 0 or null (null: measure it), got {value!r}")


# -- calibration ----------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    # CUDA kernels are asynchronous: without a sync the timer would only measure the launch.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_op(fn: Any, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _matmul_sizes(device: torch.device) -> list[int]:
    # Small sizes first: on a slow CPU the big one may not fit the budget, and the loop stops early.
    return [1024, 2048, 4096, 8192] if device.type == "cuda" else [256, 512, 1024, 1536]


def measure_peak_flops(dtype: torch.dtype, device: str | torch.device = "cpu", seconds: float = 0.5) -> float:
    """Best square-matmul FLOP/s over a few sizes, within about ``seconds`` of wall time. ``torch.int8``: int8
    operations a second (``torch._int_mm``: oneDNN's VNNI or AMX-INT8 kernels on CPU), what quantized linears'
    integer dot products are measured against."""
    device = torch.device(device)
    best = 0.0
    deadline = time.perf_counter() + seconds
    last: tuple[int, float] | None = None  # (size, seconds) of the latest matmul, to predict the next
    for n in _matmul_sizes(device):
        # Matmul time grows as n^3: skip sizes that would blow the budget (slow dtypes on CPU, e.g. bf16).
        if last is not None and last[1] * (n / last[0]) ** 3 > deadline - time.perf_counter():
            break
        if dtype == torch.int8:  # no int8 `@`: int8 x int8 -> int32
            a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
            b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
            matmul = lambda: torch._int_mm(a, b)  # noqa: E731
        else:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            matmul = lambda: a @ b  # noqa: E731
        _time_op(matmul, device)  # warm-up: kernel selection, thread pool start
        size_end = time.perf_counter() + seconds / len(_matmul_sizes(device))
        while True:
            elapsed = _time_op(matmul, device)
            best = max(best, 2 * n**3 / elapsed)
            last = (n, elapsed)
            if time.perf_counter() >= min(size_end, deadline):
                break
    return best


def measure_peak_bandwidth(
    device: str | torch.device = "cpu", nbytes: int | None = None, repeats: int = 5
) -> float:
    """Best bytes/s of copying one large tensor into another (read + write both counted).

    The default size is far larger than any CPU cache (256 MiB) or GPU L2 (1 GiB), so caches do not flatter it.
    """
    device = torch.device(device)
    nbytes = nbytes or (1024 * _MIB if device.type == "cuda" else 256 * _MIB)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: touch every page so first-use page faults are not timed
    best = 0.0
    for _ in range(repeats):
        elapsed = _time_op(lambda: dst.copy_(src), device)
        best = max(best, 2 * src.numel() * src.element_size() / elapsed)
    return best


# -- the monitor ----------------------------------------------------------------------------------------------


# The record fields the cost model reads.
_COST_FIELDS = ("num_prefill_tokens", "num_decode_tokens", "num_sampled", "attn_pairs", "context_tokens")


def as_floats(values: np.ndarray) -> np.ndarray:
    """An object array of Python numbers as float64, each converted as ``float()`` converts it."""
    return np.array([float(value) for value in values], dtype=np.float64)


def _ratio(numerator: float, seconds: float, peak: float | None) -> float | None:
    if peak is None or peak <= 0 or seconds <= 0:
        return None
    return numerator / seconds / peak


class Monitor:
    """Adds ``flops``, ``bytes``, ``mfu`` and ``mbu`` to step records and sums them over a run."""

    def __init__(self, cost: ModelCost, peak_flops: float | None, peak_bandwidth: float | None) -> None:
        self.cost = cost
        self.peak_flops = peak_flops
        self.peak_bandwidth = peak_bandwidth

    @classmethod
    def from_config(
        cls, cost: ModelCost, config: MonitorConfig, dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> "Monitor":
        """Peaks from ``config``, measuring on ``device`` whatever it leaves out (when ``calibrate``): FLOP/s of
        ``dtype``'s matmul, or int8's where the cost says the linears multiply in int8."""
        peak_flops, peak_bandwidth = config.peak_flops, config.peak_bandwidth
        if config.calibrate and peak_flops is None:
            peak_flops = measure_peak_flops(torch.int8 if cost.int8_matmuls else dtype, device)
        if config.calibrate and peak_bandwidth is None:
            peak_bandwidth = measure_peak_bandwidth(device)
        return cls(cost, peak_flops, peak_bandwidth)

    def annotate(self, step: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``step`` with its FLOPs, bytes and utilisations (``None`` where a peak is unknown)."""
        flops = self.cost.step_flops(step)
        nbytes = self.cost.step_bytes(step)
        duration = step["duration"]
        return {
            **step,
            "flops": flops,
            "bytes": nbytes,
            "mfu": _ratio(flops, duration, self.peak_flops),
            "mbu": _ratio(nbytes, duration, self.peak_bandwidth),
        }

    def annotate_columns(self, steps: StepColumns) -> StepColumns:
        """``annotate`` for many steps at once (their records as columns): the same figures, step by step."""
        # Object arrays of Python numbers: the cost model's own arithmetic, exactly as for one record.
        values = {key: steps.value(key).astype(object) for key in _COST_FIELDS}
        flops = (as_floats(self.cost.step_matmul_work(values)) + as_floats(self.cost.step_attention_work(values)))
        nbytes = as_floats(self.cost.step_bytes_work(values))
        duration = steps.value("duration")
        out = steps.with_column("flops", flops).with_column("bytes", nbytes)
        for key, work, peak in (("mfu", flops, self.peak_flops), ("mbu", nbytes, self.peak_bandwidth)):
            if peak is None or peak <= 0:
                out = StepColumns([*out.keys, key], out.columns, {**out.constants, key: None})
                continue
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = work / duration / peak
            if (duration <= 0).any():   # no time, no utilisation (``_ratio``)
                ratio = ratio.astype(object)
                ratio[duration <= 0] = None
            out = out.with_column(key, ratio)
        return out

    def overall(self, steps: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        """Run-level utilisation: total work over total step time (so long steps weigh more, as they should)."""
        total_flops = total_bytes = total_time = 0.0
        for step in steps:
            total_flops += self.cost.step_flops(step)
            total_bytes += self.cost.step_bytes(step)
            total_time += step["duration"]
        return {
            "total_flops": total_flops,
            "total_bytes": total_bytes,
            "mfu": _ratio(total_flops, total_time, self.peak_flops),
            "mbu": _ratio(total_bytes, total_time, self.peak_bandwidth),
            "peak_flops": self.peak_flops,
            "peak_bandwidth": self.peak_bandwidth,
        }
