"""Shared pytest fixtures."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

import pytest

from nanovllm import machine

# The suite's simulated runs use the shipped step-time profiles, never one a developer calibrated on this machine
# (python -m nanovllm.harness.sim.calibrate --this-machine): an empty per-machine cache, inherited by subprocesses.
os.environ["NANOVLLM_SIM_PROFILES"] = tempfile.mkdtemp(prefix="nanovllm-sim-profiles-")


def _remove_own_dir(path: str = os.environ["NANOVLLM_SIM_PROFILES"], owner: int = os.getpid()) -> None:
    """Remove this process's empty profile cache (or its Ray temp dir) at exit (each xdist worker makes its own),
    so runs leave no directory in the temp dir. A forked child that runs atexit handlers leaves it to the process
    that made it."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_remove_own_dir)

# Each process of the suite (each xdist worker) gives Ray a temp dir of its own, inherited by the subprocesses it
# starts: two workers' Ray instances never share a session, and a test's "no Ray process is left" check counts
# its own worker's daemons only (``helpers.ray_processes``), not those of a Ray test running beside it.
os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray-")
atexit.register(_remove_own_dir, os.environ["RAY_TMPDIR"])

from nanovllm.kernels import kernel_build

# Every kernel build this CPU can run (amx shares avx512_bf16's), best first: the kernel tests run each one, so
# a machine with AVX-512 BF16 also tests the AVX-512, AVX2 and scalar paths.
KERNEL_BUILDS = list(dict.fromkeys(kernel_build(level) for level in machine.supported_isas()))


def pytest_report_header(config) -> str:
    return (f"nano-vllm: CPU {machine.cpu_model()}; ISA level in force {machine.selected_isa()}; "
            f"kernel paths tested: {', '.join(KERNEL_BUILDS)}")


@pytest.fixture(params=KERNEL_BUILDS)
def kernel_isa(request) -> str:
    """Each kernel build (ISA level) this CPU supports, one test run each."""
    return request.param


@pytest.fixture
def compiled(kernel_isa):
    """The compiled CPU kernels of ``kernel_isa`` (built on first use, cached per machine)."""
    from nanovllm import kernels

    return kernels.load(kernel_isa)


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's Hugging Face tokenizer (converted model is cached after the first run)."""
    from transformers import AutoTokenizer

    from nanovllm.models.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model())


@pytest.fixture(scope="session")
def llm():
    """One engine on the default model for the whole session (float32, small cache). Other engines built in
    the session reuse its loaded weights (the loader caches models while any engine holds them)."""
    from nanovllm import LLM

    return LLM(num_kv_blocks=1024, max_model_len=1024)


@pytest.fixture(scope="session")
def hf_model(llm):
    """The transformers reference on the same weights, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32)
    return model.eval()


PARITY_MAX_TOKENS = 24


def _parity_prompts(tokenizer) -> list[list[int]]:
    """16 varied prompts as token ids: chat-templated questions, raw text, code, and several longer than
    four 16-token blocks."""
    from nanovllm.chat_template import chat_token_ids
    from nanovllm.harness.workload import load_chat_prompts

    chat_ids = [chat_token_ids(tokenizer, messages) for messages in load_chat_prompts()]
    by_length = sorted(chat_ids, key=len)
    chat_ids = by_length[:4] + by_length[-4:]  # four short chats and the four longest (well over 4 blocks)
    short_answer = [{"role": "user", "content": "What is the capital of France?"}]  # ends on EOS quickly
    chat_ids.append(chat_token_ids(tokenizer, short_answer))
    raw = [
        "The quick brown fox",
        "def fibonacci(n):\n    ",
        "1, 2, 3, 5, 8, 13,",
        "In 1905, Albert Einstein published four papers that",
        "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of",
        "Q: What is the boiling point of water at sea level?\nA:",
        "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
        "who had never once left the valley. Every morning he opened his shop, wound every clock, and",
        "A",
    ]
    return chat_ids + [tokenizer.encode(text) for text in raw]


@pytest.fixture(scope="session")
def parity_prompts(tokenizer) -> list[list[int]]:
    return _parity_prompts(tokenizer)


@pytest.fixture(scope="session")
def hf_references(llm, hf_model, parity_prompts, tmp_path_factory, worker_id):
    """transformers' greedy tokens and per-position top-5 on the parity prompts by dtype, computed on first use
    (one reference model each) and shared by every module that holds a path to the close standard.

    Computed once per test session, not once per pytest-xdist worker: the first worker to need a dtype computes
    it under a file lock and writes it to the session's shared temporary directory, and the others read that
    file. Each worker computing its own cost ~30 s per dtype on a 2-core AVX2 machine."""
    import filelock
    import torch
    from transformers import AutoModelForCausalLM

    from nanovllm.validate import reference_greedy_top

    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent  # the session's directory, above each worker's own
    cache: dict[str, list] = {}

    def compute(dtype: str) -> list:
        model = hf_model if dtype == "float32" else AutoModelForCausalLM.from_pretrained(
            llm.engine.model_dir, dtype=getattr(torch, dtype)).eval()
        return reference_greedy_top(model, parity_prompts, PARITY_MAX_TOKENS)

    def get(dtype: str) -> list:
        if dtype not in cache:
            path = shared / f"hf_references_{dtype}.json"
            with filelock.FileLock(f"{path}.lock"):
                if path.exists():
                    stored = json.loads(path.read_text())
                else:
                    stored = [[tokens, [sorted(top) for top in tops]] for tokens, tops in compute(dtype)]
                    path.write_text(json.dumps(stored))
            cache[dtype] = [(tokens, [set(top) for top in tops]) for tokens, tops in stored]
        return cache[dtype]

    return get


@pytest.fixture(scope="session")
def hf_greedy(hf_references) -> list[list[int]]:
    """transformers `generate` greedy outputs, one prompt at a time (no padding), EOS-terminated, float32: the
    tokens of ``hf_references("float32")`` (the same ``generate`` call, which also keeps the logits)."""
    return [tokens for tokens, _ in hf_references("float32")]
