"""llama.cpp (llama-cpp-python) on one GGUF file, batch 1: the peer of ``bench_quantized.py``. Runs in its own
virtualenv and imports nothing of nano-vllm's:

    python -m venv ~/llama-venv && ~/llama-venv/bin/pip install --no-binary llama-cpp-python llama-cpp-python
    ~/llama-venv/bin/python experiments/llama_cpp_peer.py SPEC.json

SPEC.json: {"gguf": path, "prompt": [token ids], "max_tokens": n, "threads": t, "use_extra_bufts": bool}
(false: llama.cpp's plain CPU weight buffers, without its AMX or repacked ones). Prints one line
``nano-vllm-bench-result: {...}`` with ms per decoded token measured as bench_vs_hf.batch1_decode_ms does
((time for n tokens - time for 1) / (n - 1), prefill excluded), greedy, and the tokens it generated.
"""

import json
import sys
import time

import llama_cpp.llama_cpp
from llama_cpp import Llama


def generate(llm: Llama, prompt: list[int], n: int) -> list[int]:
    llm.reset()  # no reuse of the previous call's KV: every call prefills the prompt, like the other engines'
    out = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(token)
        if len(out) == n:
            break
    return out


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    if not spec.get("use_extra_bufts", True):
        default_params = llama_cpp.llama_cpp.llama_model_default_params

        def plain_buffers():  # Llama() exposes no such option: its model parameters start from these defaults
            params = default_params()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_cpp.llama_model_default_params = plain_buffers
    llm = Llama(model_path=spec["gguf"], n_ctx=2048, n_threads=spec["threads"], n_threads_batch=spec["threads"],
                n_batch=512, verbose=False)
    prompt, n = spec["prompt"], spec["max_tokens"]
    generate(llm, prompt, 2)  # warm-up
    short = min(timed(lambda: generate(llm, prompt, 1)) for _ in range(2))
    full = min(timed(lambda: generate(llm, prompt, n)) for _ in range(spec.get("repeats", 1)))
    tokens = generate(llm, prompt, n)
    print("nano-vllm-bench-result: " + json.dumps({
        "batch1_ms_per_token": (full - short) / (n - 1) * 1e3, "tokens": tokens,
        "llama_cpp_python": llama_cpp.__version__, "threads": spec["threads"]}))


if __name__ == "__main__":
    main()
