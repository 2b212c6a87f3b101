"""Quantized weights side by side: nano-vllm's dense paths and its int8 and GGUF paths in one process, and
llama.cpp at batch 1 on the same GGUF file (its own virtualenv, same threads).

Rows (``--paths``): ``bfloat16`` and ``float32-fast`` (the dense fast paths), ``int8`` / ``int8-bf16`` (W8A8 int8
weights, float32 / bfloat16 activations), ``gguf`` / ``gguf-bf16`` (the default model's own Q4_1 blocks, its
embedding and LM head Q8_0), ``int8-bf16-kv8`` / ``bfloat16-kv8`` (those paths on an int8 KV cache),
``gguf-python-loop`` / ``bfloat16-python-loop`` (those paths with the decoder layers in the Python loop instead of
the C++ decoder stack, ``LlamaForCausalLM.decoder_stack``: what the stack saves). Each runs the same chat prompts (greedy, EOS ignored,
``--max-tokens`` each) for tokens/s, and one of them for batch-1 ms per decoded token (prefill excluded, as
``bench_vs_hf.py`` measures it). A second run of the same prompts, one token each, times the prefill; the
rest of the full run's time, per token decoded after the first, gives the decode throughput. Every row's engine
is built first; then ``--rounds`` rounds time each row's two runs in turn, and the fastest round is printed (on a
shared machine one row's single run could land in another tenant's busy spell, and interference only ever adds
time), with the median tok/s beside it, and each round's ratio to the bfloat16 row's run of the same round (min / median /
max: a round's rows run back to back, so a slow or fast spell of the machine lands on both sides of the ratio);
the JSON keeps every round. Also: load time
(engine construction, model files already cached), the bytes of weight data one decode step reads, and how
many outputs equal the bfloat16 path's. llama.cpp
(``llama_cpp_peer.py``) runs the batch-1 measurement on the GGUF file the gguf rows read:

    python -m venv ~/llama-venv && ~/llama-venv/bin/pip install --no-binary llama-cpp-python llama-cpp-python
    python experiments/bench_quantized.py [--num-prompts 32] [--max-tokens 64] [--paths ...]
                                          [--llama-python ~/llama-venv/bin/python] [--batch1-repeats 5]
                                          [--rounds 3]
                                          [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_hf import batch1_decode_ms, chat_prompts, run_nanovllm  # noqa: E402

from nanovllm import LLM, machine  # noqa: E402
from nanovllm.models.loader import default_gguf_path  # noqa: E402

PATHS = {
    "bfloat16": dict(dtype="bfloat16"),
    "float32-fast": dict(dtype="float32", fuse_projections=True),
    "int8": dict(dtype="float32", quantization="int8"),
    "int8-bf16": dict(dtype="bfloat16", quantization="int8"),
    "gguf": dict(dtype="float32", quantization="gguf"),
    "gguf-bf16": dict(dtype="bfloat16", quantization="gguf"),
    # 8-bit weights and an 8-bit KV cache (kv_cache_dtype=int8): a decode step's two big reads both halved.
    "int8-bf16-kv8": dict(dtype="bfloat16", quantization="int8", kv_cache_dtype="int8"),
    "bfloat16-kv8": dict(dtype="bfloat16", kv_cache_dtype="int8"),
    # The same model with the decoder layers in the Python loop instead of the C++ decoder stack: what it saves.
    "gguf-python-loop": dict(dtype="float32", quantization="gguf", decoder_stack=False),
    "bfloat16-python-loop": dict(dtype="bfloat16", decoder_stack=False),
}
PEER = Path(__file__).resolve().parent / "llama_cpp_peer.py"
RESULT_PREFIX = "nano-vllm-bench-result: "


class PathRun:
    """One row's engine, built once; its full and prefill-only runs are timed in rounds that alternate with the
    other rows' (``timed_round``), so that a slow spell of a shared machine lands on every row alike."""

    def __init__(self, path: str, num_prompts: int, max_tokens: int) -> None:
        options = dict(PATHS[path])
        self.path, self.num_prompts, self.max_tokens = path, num_prompts, max_tokens
        self.decoder_stack = options.pop("decoder_stack", True)
        start = time.perf_counter()
        self.llm = LLM(num_kv_blocks=2048, max_model_len=2048, **options)
        self.load_s = time.perf_counter() - start
        self.prompts = chat_prompts(self.llm, num_prompts)
        self.full_s: list[float] = []
        self.prefill_s: list[float] = []
        self.outputs: list[list[int]] = []
        # Warm-up: the whole workload once, untimed. The engine's own warm-up covers its step shapes, but the
        # first full run in a process still measured slower (the first path of a run was penalised against later
        # ones of the same kind).
        with self.stack():
            run_nanovllm(self.llm, self.prompts, max_tokens)

    @contextlib.contextmanager
    def stack(self):
        """This row's decoder-loop choice on the model while it runs (the loader may share one model between rows)."""
        self.llm.engine.runner.model.use_decoder_stack = self.decoder_stack
        try:
            yield
        finally:
            self.llm.engine.runner.model.use_decoder_stack = True

    def timed_round(self) -> None:
        """The workload once (tok/s), then the same prompts for one token each: the run's prefill (and first
        token), so that the rest of the run's time is its decode steps, where weight bytes matter most."""
        with self.stack():
            seconds, self.outputs = run_nanovllm(self.llm, self.prompts, self.max_tokens)
            prefill_s, _ = run_nanovllm(self.llm, self.prompts, 1)
        self.full_s.append(seconds)
        self.prefill_s.append(prefill_s)

    def result(self, batch1_repeats: int) -> dict:
        """The fastest round (interference only ever adds time, as for batch 1) and the median, each round's
        tok/s, batch 1 (fastest of its repeats), load time."""
        with self.stack():
            b1 = batch1_decode_ms(lambda p, n: run_nanovllm(self.llm, [p], n), self.prompts[0], self.max_tokens,
                                  batch1_repeats)
        decode = [self.num_prompts * (self.max_tokens - 1) / (f - p) for f, p in zip(self.full_s, self.prefill_s)
                  if f > p]
        tokens = self.num_prompts * self.max_tokens
        return {"path": self.path, **PATHS[self.path], "tok_s": tokens / min(self.full_s),
                "tok_s_median": tokens / statistics.median(self.full_s),
                "tok_s_rounds": [tokens / s for s in self.full_s], "batch1_ms_per_token": b1,
                "prefill_ms": min(self.prefill_s) * 1e3, "decode_tok_s": max(decode) if decode else float("nan"),
                "load_s": self.load_s, "weight_bytes": self.llm.engine.runner.model.streamed_weights()[0],
                "outputs": self.outputs, "prompts": self.prompts}


def run_llama_cpp(python: str, prompt: list[int], max_tokens: int, threads: int, repeats: int) -> dict:
    """llama.cpp's batch-1 result, with its extra weight buffer types (AMX, repacked layouts) as it picks them;
    when that run crashes, once more without them (its AMX buffer type segfaults on Q4_1 weights on some AMX
    Xeons: llama.cpp issues #20824 and PR #16315), saying so in the result. A run that fails both ways gives
    ``{"error": ...}``, so nano-vllm's rows are still printed."""
    errors = []
    for extra_buffer_types in (True, False):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"gguf": str(default_gguf_path()), "prompt": prompt, "max_tokens": max_tokens,
                       "threads": threads, "repeats": repeats, "use_extra_bufts": extra_buffer_types}, f)
        try:
            done = subprocess.run([python, str(PEER), f.name], capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        finally:
            os.unlink(f.name)
        lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        if done.returncode == 0 and lines:
            result = json.loads(lines[-1][len(RESULT_PREFIX):])
            result["extra_buffer_types"] = extra_buffer_types
            if errors:
                result["note"] = f"with its extra buffer types it failed ({errors[0]})"
            return result
        reason = f"exit status {done.returncode}" + (f" (signal {-done.returncode})" if done.returncode < 0 else "")
        errors.append(reason)
        print(f"llama.cpp (extra buffer types {'on' if extra_buffer_types else 'off'}) failed: {reason}\n"
              f"{done.stderr[-1500:]}", file=sys.stderr, flush=True)
    return {"error": "; ".join(errors)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated rows: {', '.join(PATHS)}")
    parser.add_argument("--llama-python", default=None, help="the python of a virtualenv with llama-cpp-python")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed runs of the workload per row, the rows taking turns; the fastest counts")
    parser.add_argument("--batch1-repeats", type=int, default=5,
                        help="batch-1 runs per engine (nano-vllm's paths and llama.cpp alike); the fastest counts")
    args = parser.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if not paths or unknown:
        parser.error(f"--paths must list some of {', '.join(PATHS)}, got {args.paths!r}")
    if args.llama_python and not Path(args.llama_python).exists():
        parser.error(f"--llama-python: {args.llama_python} does not exist")
    threads = torch.get_num_threads()
    info = machine.describe(threads)
    print(machine.header(info=info), flush=True)
    runs = [PathRun(p, args.num_prompts, args.max_tokens) for p in paths]
    for _ in range(args.rounds):
        for run in runs:
            run.timed_round()
    results = [run.result(args.batch1_repeats) for run in runs]
    peer = run_llama_cpp(args.llama_python, results[0]["prompts"][0], args.max_tokens, threads,
                         args.batch1_repeats) \
        if args.llama_python else None
    if peer and "error" in peer:
        print(f"llama.cpp ({args.llama_python}) failed: {peer['error']}; its column is left empty")
        peer = None
    by_path = {r["path"]: r for r in results}
    reference = by_path.get("bfloat16")
    print(f"workload: {args.num_prompts} chat prompts, {args.max_tokens} new tokens each (greedy), {threads} threads,"
          f" one process; fastest of {args.rounds} rounds, the rows taking turns (median tok/s beside it)"
          + (f"; llama.cpp {peer['llama_cpp_python']} at batch 1" if peer else ""))
    # Each round's ratio to bfloat16's run of the same round: the rows of a round run back to back, so a shared
    # machine's slow or fast spell lands on both sides of a ratio (the fastest rounds of two rows need not).
    if reference:
        for r in results:
            r["vs_bfloat16_rounds"] = [a / b for a, b in zip(r["tok_s_rounds"], reference["tok_s_rounds"])]
    print("| path | activations | tok/s | median tok/s | vs bfloat16 | vs bfloat16 per round (min / median / max) "
          "| vs float32-fast | prefill ms | decode tok/s "
          "| decode vs bfloat16 | batch-1 ms/token | llama.cpp ms / ours at batch 1 | load s "
          "| weight MB read per step | outputs = bfloat16's |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        rounds = r.get("vs_bfloat16_rounds")
        per_round = (f"{min(rounds):.2f} / {statistics.median(rounds):.2f} / {max(rounds):.2f}" if rounds else "-")
        vs = {name: (f"{r['tok_s'] / by_path[name]['tok_s']:.2f}x" if name in by_path else "-")
              for name in ("bfloat16", "float32-fast")}
        vs_peer = f"{peer['batch1_ms_per_token'] / r['batch1_ms_per_token']:.2f}x" if peer else "-"
        same = (f"{sum(a == b for a, b in zip(r['outputs'], reference['outputs']))}/{args.num_prompts}"
                if reference else "-")
        decode_vs = f"{r['decode_tok_s'] / reference['decode_tok_s']:.2f}x" if reference else "-"
        print(f"| {r['path']} | {r['dtype']} | {r['tok_s']:.1f} | {r['tok_s_median']:.1f} | {vs['bfloat16']} | "
              f"{per_round} | {vs['float32-fast']} | "
              f"{r['prefill_ms']:.0f} | {r['decode_tok_s']:.1f} | {decode_vs} | "
              f"{r['batch1_ms_per_token']:.2f} | {vs_peer} | {r['load_s']:.1f} | {r['weight_bytes'] / 1e6:.0f} | {same} |")
    if peer:
        buffers = "its extra buffer types on" if peer["extra_buffer_types"] else \
            f"its extra buffer types off: {peer.get('note', '')}"
        print(f"llama.cpp batch 1 on {default_gguf_path().name}: {peer['batch1_ms_per_token']:.2f} ms/token ({buffers})")
    if args.json:
        for r in results:
            del r["outputs"], r["prompts"]
        with open(args.json, "w") as f:
            json.dump({"num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "threads": threads,
                       "machine": info, "results": results, "llama_cpp": peer}, f, indent=2)


if __name__ == "__main__":
    main()
