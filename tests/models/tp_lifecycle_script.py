"""Driven by tests/models/test_tensor_parallel.py in a subprocess: builds a TP=2 engine, prints its worker pids, then
ends one way (``normal``, ``exception``, ``sigint`` -- waits to be interrupted mid-generation --,
``kill_worker`` -- SIGKILLs the worker between steps --, ``kill_mid_step`` -- SIGKILLs it while generating)."""

from __future__ import annotations

import os
import signal
import sys
import threading

from nanovllm import LLM, SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def main(mode: str) -> None:
    # Ctrl-C must raise KeyboardInterrupt here, as in an interactive program. Python arranges that at startup
    # only if SIGINT was not ignored when the process started -- and a command started in the background of a
    # non-interactive shell (`pytest ... &`, as a long suite run often is) starts with SIGINT ignored, which
    # the child inherits: the signal would then be dropped and the generation would finish with status 0.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # No warm-up: what is checked is how the processes end, and warming both ranks up cost each run ~3 s.
    llm = LLM(tensor_parallel_size=2, num_kv_blocks=128, max_model_len=512, warmup=False)
    print("worker pids:", *llm.engine.runner.worker_pids, flush=True)
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    (worker,) = llm.engine.runner.worker_pids
    if mode == "exception":
        raise RuntimeError("user code failed")
    if mode == "sigint":
        print("generating", flush=True)
        llm.generate(["Tell me a long story."] * 4, LONG, use_tqdm=False)
    if mode == "kill_worker":
        os.kill(worker, signal.SIGKILL)
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    if mode == "kill_mid_step":
        threading.Timer(1.0, os.kill, (worker, signal.SIGKILL)).start()
        llm.generate(["Tell me a long story."] * 4, LONG, use_tqdm=False)
    print("done", flush=True)


if __name__ == "__main__":  # the workers are spawned: they re-import this file, which must not run main again
    main(sys.argv[1])
