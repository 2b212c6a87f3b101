"""``python -m nanovllm.profile``: where one engine step goes, for a model, dtype and attention backend.

Runs decode steps at several numbers of running sequences (default 1, 16, 64, 256) and one prefill step, and
prints per step: total ms (the fastest of ``--steps`` steps, measured without the profiler), and from a torch.profiler run of the same steps the
time in attention, linear layers, LM head + sampling, and scheduler + batch preparation; then the GEMM floor
(the step's matmuls, the same modules on inputs of the same shape, timed alone, also the fastest of several
runs) and total / floor: both sides are best times, because load on a shared machine only ever adds time. The
achieved matmul FLOP/s is compared with the peak the monitor calibrates (``measure_peak_flops``; int8's for
``--quantization``, whose linears multiply in int8), so the numbers match the MFU that runs report. Each case
also writes a Chrome trace (open in chrome://tracing or https://ui.perfetto.dev).

    python -m nanovllm.profile [--dtype bfloat16] [--attention auto] [--batch-sizes 1,16,64,256]
                               [--context 128] [--prefill-tokens 512] [--steps 5] [--trace-dir DIR]
                               [--fuse-projections auto|true|false] [--quantization int8|gguf]
                               [--kv-cache-dtype auto|int8|fp8_e4m3]

After the table it prints how the decoder layers run (``layer_loop``) and which kernel (and ISA) each linear layer
runs at each batch size. The profiled run always takes the Python loop over the layers, so the profiler sees each
kernel as its own op; where the fast path runs them as one C++ loop instead (``decoder_stack.cpp``), the total
column is that loop's, and the columns in between include the Python loop's per-call cost that it saves.

The running sequences have distinct prompts (no prefix cache), so a decode step reads as much KV cache as real
traffic does: with one shared prompt every sequence would read the same few cached blocks from the CPU's caches
and attention would look faster than it is. Setting up 256 of them costs their prefills.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from nanovllm import machine
from nanovllm.config import torch_dtype
from nanovllm.kernels import ISA_CFLAGS
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.sampling import SamplingParams

# Profiler op names that are one whole linear layer (the fused/prepacked path and plain F.linear).
LINEAR_OPS = frozenset({"aten::linear", "mkldnn::_linear_pointwise",
                        *(f"nanovllm_{build}::{op}" for build in ISA_CFLAGS  # each kernel build's ops
                          for op in ("gemv_bf16", "quant_linear", "brgemm_linear", "int8_amx_linear",
                                     "q4x16_linear", "i8x16_linear", "q8x16_linear",
                                     "bf16_fma_linear"))})
SECTIONS = ("attention", "lm_head_sampling", "scheduler_preparation")


@dataclass
class StepProfile:
    label: str
    tokens: int
    total_ms: float
    attention_ms: float
    linears_ms: float
    lm_head_sampling_ms: float
    scheduler_preparation_ms: float
    gemm_floor_ms: float
    gemm_gflops: float

    @property
    def floor_ratio(self) -> float:
        return self.total_ms / self.gemm_floor_ms

    @property
    def overhead_share(self) -> float:
        return self.scheduler_preparation_ms / self.total_ms


def _wrap(owner: Any, name: str, section: str) -> None:
    """Mark every call of ``owner.<name>`` as a profiler range ``section`` (on this instance only)."""
    method = getattr(owner, name)

    def wrapped(*args, **kwargs):
        with record_function(section):
            return method(*args, **kwargs)

    setattr(owner, name, wrapped)


def instrument(engine) -> None:
    """Profiler ranges around the parts of a step; the engine's own code is untouched."""
    runner = engine.runner
    _wrap(engine.scheduler, "schedule", "scheduler_preparation")
    _wrap(runner, "_prepare", "scheduler_preparation")
    _wrap(runner.backend, "plan", "scheduler_preparation")
    _wrap(runner.backend, "forward", "attention")
    _wrap(runner.model, "compute_logits", "lm_head_sampling")
    _wrap(runner, "sampler", "lm_head_sampling")


def _ranges(events, name: str) -> list[tuple[float, float]]:
    return [(e.time_range.start, e.time_range.end) for e in events if e.name == name]


def _inside(event, ranges: list[tuple[float, float]]) -> bool:
    return any(start <= event.time_range.start and event.time_range.end <= end for start, end in ranges)


def breakdown(events, steps: int) -> dict[str, float]:
    """ms per step in each section, and in linear layers outside the LM head."""
    result = {}
    for section in SECTIONS:
        result[section] = sum(end - start for start, end in _ranges(events, section)) / 1e3 / steps
    lm_head = _ranges(events, "lm_head_sampling")
    linear_us = sum(e.time_range.end - e.time_range.start for e in events
                    if e.name in LINEAR_OPS and not _inside(e, lm_head))
    result["linears"] = linear_us / 1e3 / steps
    return result


def kernel_of(linear: nn.Module, rows: int) -> str:
    """Which kernel, at which ISA, runs ``linear`` on ``rows`` rows: the choice each layer makes per call."""
    # The model code imports transformers: only once a model is profiled (--help and argument errors stay instant).
    from nanovllm.models.fast_path import PackedLinear
    from nanovllm.models.quantized import QuantLinear

    if isinstance(linear, QuantLinear):
        return linear.kernel_name()
    if isinstance(linear, PackedLinear):
        if linear.kernel == "brgemm":
            unit = "AMX tiles" if machine.selected_isa() == "amx" and linear.packed.dtype == torch.bfloat16 else \
                f"ISA up to {machine.selected_isa()}"
            return f"nano-vllm brgemm_linear (oneDNN brgemm, {unit})"
        if linear.kernel == "bf16-fma":
            return f"nano-vllm bf16_fma_linear (bf16 weights, float32 FMA, {linear.kernels.isa})"
        if linear.kernel == "onednn+gemv" and rows <= linear.GEMV_MAX_ROWS:
            return f"nano-vllm gemv_bf16 ({linear.kernels.isa})"
        return f"oneDNN prepacked GEMM (ISA up to {machine.selected_isa()})"
    return f"torch F.linear (ATen {torch.backends.cpu.get_cpu_capability()})"


def named_linears(model: LlamaForCausalLM) -> list[tuple[str, nn.Module]]:
    """The linears of the first decoder layer and the LM head, by name: every layer repeats the first's choice."""
    layer = model.layers[0]
    names = [("qkv_proj", "self_attn.qkv_proj"), ("q_proj", "self_attn.q_proj"), ("k_proj", "self_attn.k_proj"),
             ("v_proj", "self_attn.v_proj"), ("o_proj", "self_attn.o_proj"), ("gate_up_proj", "mlp.gate_up_proj"),
             ("gate_proj", "mlp.gate_proj"), ("up_proj", "mlp.up_proj"), ("down_proj", "mlp.down_proj")]
    found = []
    for label, path in names:
        owner, _, attr = path.partition(".")
        module = getattr(getattr(layer, owner), attr, None)
        if module is not None:
            found.append((label, module))
    head = model.lm_head_chunks[0] if model.lm_head_chunks is not None else model.lm_head
    found.append(("lm_head", head))
    return found


def layer_loop(model: LlamaForCausalLM) -> str:
    """How a step outside the profiler runs ``model``'s decoder layers: the C++ decoder stack, or the Python loop
    and why."""
    if getattr(model, "kernels", None) is None:
        return "the Python loop (no fused CPU kernels: the reference path or a GPU)"
    if not getattr(model, "use_decoder_stack", False):
        return "the Python loop (use_decoder_stack is off)"
    if model.decoder_stack() is None:
        return ("the Python loop (a layer the C++ stack does not run: q/k norm, a tensor-parallel shard, a "
                "subclassed layer)")
    return ("one C++ loop (nanovllm/csrc/decoder_stack.cpp) on steps whose attention is the cpu kernel alone; "
            "the profiled run takes the Python loop")


def format_kernels(model: LlamaForCausalLM, batch_sizes: list[int]) -> str:
    """A table: each linear's shape and the kernel it runs at each decode batch size."""
    lines = ["| linear | shape (out x in) | " + " | ".join(f"{b} rows" for b in batch_sizes) + " |",
             "|" + "---|" * (2 + len(batch_sizes))]
    for label, module in named_linears(model):
        out_f, in_f = module.out_features, module.in_features
        lines.append(f"| {label} | {out_f} x {in_f} | " + " | ".join(kernel_of(module, b) for b in batch_sizes) + " |")
    return "\n".join(lines)


def gemm_floor(model: LlamaForCausalLM, rows: int, sampled: int, dtype: torch.dtype, repeats: int = 5) -> tuple[float, float]:
    """(ms, GFLOP/s): the step's matmuls, the model's own modules on inputs of the step's shape, timed alone."""
    mods = model.linear_layers()
    inputs = [torch.randn(rows, m.in_features).to(dtype) for m in mods]
    head_input = torch.randn(sampled, model.config.hidden_size).to(dtype)
    flops = 2 * rows * sum(m.in_features * m.out_features for m in mods)
    flops += 2 * sampled * model.config.hidden_size * model.config.vocab_size

    def run() -> None:
        for m, x in zip(mods, inputs):
            m(x)
        model.compute_logits(head_input)

    with torch.inference_mode():
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    best = min(times)
    return best * 1e3, flops / best / 1e9


def run_gemm_floor(model: LlamaForCausalLM, records: list[dict], dtype: torch.dtype) -> tuple[float, float]:
    """(seconds, GFLOP): the matmuls of a whole recorded run (``LLM.last_steps``), timed alone.

    Each step computes ``num_prefill_tokens + num_decode_tokens`` rows through every linear layer and
    ``num_sampled`` rows through the LM head; steps of the same shape are timed once and counted as often as
    they ran. No engine can serve that run faster than this with the same matmul library, so it bounds every
    throughput ratio measured on the run."""
    shapes: dict[tuple[int, int], int] = {}
    for record in records:
        rows = record["num_prefill_tokens"] + record["num_decode_tokens"]
        if rows:
            key = (rows, record["num_sampled"])
            shapes[key] = shapes.get(key, 0) + 1
    seconds = gflop = 0.0
    for (rows, sampled), count in shapes.items():
        ms, gflops = gemm_floor(model, rows, sampled, dtype, repeats=3)
        seconds += count * ms / 1e3
        gflop += count * ms / 1e3 * gflops
    return seconds, gflop


def _time_steps(engine, steps: int) -> float:
    """ms of the fastest of ``steps`` steps: the same statistic as the GEMM floor's, so their ratio compares
    like with like."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def _profiled(engine, steps: int, trace: Path) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    prof.export_chrome_trace(str(trace))
    return breakdown(prof.events(), steps)


def profile_decode(make_llm: Callable[..., Any], num_seqs: int, context: int, steps: int,
                   trace_dir: Path) -> StepProfile:
    """Decode steps with ``num_seqs`` running sequences of about ``context`` tokens."""
    llm = make_llm(max_num_seqs=num_seqs)
    engine = llm.engine
    generator = torch.Generator().manual_seed(num_seqs)
    params = SamplingParams(temperature=0, max_tokens=3 * steps + 8, ignore_eos=True)
    for _ in range(num_seqs):
        prompt = torch.randint(10, 40000, (context,), generator=generator).tolist()
        engine.add_request(engine.make_request(prompt, params))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    instrument(engine)
    total = _time_steps(engine, steps)
    parts = _profiled(engine, steps, trace_dir / f"decode_{num_seqs}.json")
    floor_ms, gflops = gemm_floor(engine.runner.model, num_seqs, num_seqs, engine.runner.dtype)
    return StepProfile(f"decode x{num_seqs}", num_seqs, total, parts["attention"], parts["linears"],
                       parts["lm_head_sampling"], parts["scheduler_preparation"], floor_ms, gflops)


def profile_prefill(make_llm: Callable[..., Any], tokens: int, steps: int, trace_dir: Path) -> StepProfile:
    """A step that prefills one ``tokens``-token prompt (a fresh request each time)."""
    llm = make_llm(max_num_seqs=4, max_num_batched_tokens=max(tokens, 2048))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def step_fresh_prompt() -> None:
        prompt = torch.randint(10, 40000, (tokens,)).tolist()
        engine.add_request(engine.make_request(prompt, params))
        engine.step()

    class _Stepper:  # what _time_steps and _profiled call
        step = staticmethod(step_fresh_prompt)

    step_fresh_prompt()  # warm-up
    instrument(engine)
    total = _time_steps(_Stepper, steps)
    parts = _profiled(_Stepper, steps, trace_dir / f"prefill_{tokens}.json")
    floor_ms, gflops = gemm_floor(engine.runner.model, tokens, 1, engine.runner.dtype)
    return StepProfile(f"prefill {tokens}", tokens, total, parts["attention"], parts["linears"],
                       parts["lm_head_sampling"], parts["scheduler_preparation"], floor_ms, gflops)


def format_table(rows: list[StepProfile], peak_gflops: float, peak_kind: str = "") -> str:
    """The profile's table; ``peak_kind`` names the peak the GEMM rate is against ("int8 " for quantized linears)."""
    header = ("| step | total ms | attention | linears | LM head + sampling | scheduler + prep | GEMM floor ms "
              "| total / floor | GEMM GFLOP/s ({}peak {:.0f}) |".format(peak_kind, peak_gflops))
    lines = [header, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r.label} | {r.total_ms:.1f} | {r.attention_ms:.1f} | {r.linears_ms:.1f} | "
            f"{r.lm_head_sampling_ms:.1f} | {r.scheduler_preparation_ms:.1f} ({100 * r.overhead_share:.1f}%) | "
            f"{r.gemm_floor_ms:.1f} | {r.floor_ratio:.2f}x | {r.gemm_gflops:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--fuse-projections", choices=("auto", "true", "false"), default="auto",
                        help="the fast path's fused, prepacked weights and fused kernels (auto: unless float32)")
    parser.add_argument("--quantization", choices=("int8", "gguf"), default=None,
                        help="quantized weights (int8 W8A8, or the GGUF file's own blocks)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8_e4m3"), default="auto",
                        help="the KV cache's dtype (EngineConfig.kv_cache_dtype; auto: the model dtype)")
    parser.add_argument("--batch-sizes", default="1,16,64,256", help="running sequences per decode step")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens of each running sequence")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="0 skips the prefill step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice, all cores); 1 is steadier on a busy machine")
    parser.add_argument("--trace-dir", default="outputs/profile", help="where the Chrome traces go")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"--batch-sizes must be positive integers, got {args.batch_sizes!r}")
        # The engine (transformers) after the arguments are checked: a bad one is an instant error.
        from nanovllm import LLM
        from nanovllm.serving.monitor import measure_peak_flops

        fuse = {"auto": None, "true": True, "false": False}[args.fuse_projections]
        trace_dir = Path(args.trace_dir)
        trace_dir.mkdir(parents=True, exist_ok=True)
        blocks = max(batch_sizes) * (-(-(args.context + 4 * args.steps + 16) // 16) + 1) + 64
        blocks = max(blocks, -(-args.prefill_tokens // 16) * 2 + 16)

        def make_llm(**options):
            return LLM(model=args.model, dtype=args.dtype, attention=args.attention, num_kv_blocks=blocks,
                       fuse_projections=fuse, quantization=args.quantization,
                       kv_cache_dtype=args.kv_cache_dtype, **options)

        rows = [profile_decode(make_llm, b, args.context, args.steps, trace_dir) for b in batch_sizes]
        model = make_llm().engine.runner.model
        kernels_table, loop = format_kernels(model, batch_sizes), layer_loop(model)
        if args.prefill_tokens:
            rows.append(profile_prefill(make_llm, args.prefill_tokens, args.steps, trace_dir))
        # Quantized linears multiply in int8: their GEMMs are measured against int8's peak, not the model dtype's.
        peak = measure_peak_flops(torch.int8 if args.quantization else torch_dtype(args.dtype), "cpu") / 1e9
        peak_kind = "int8 " if args.quantization else ""
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"model {args.model or 'SmolLM2-135M-Instruct'}, {args.dtype}, attention={args.attention}, "
          f"fuse_projections={args.fuse_projections}, quantization={args.quantization}, "
          f"kv_cache_dtype={args.kv_cache_dtype}, "
          f"{torch.get_num_threads()} threads, context {args.context} tokens")
    print(format_table(rows, peak, peak_kind))
    print(f"Decoder layers: {loop}")
    print("Kernels per linear (every decoder layer runs the first's):")
    print(kernels_table)
    print(f"Chrome traces: {trace_dir}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
