"""Tensor parallelism (``tensor_parallel_size=2`` on CPU, gloo): greedy float32 output equals the single-process
engine's (and so transformers') on the parity prompts, also under repeated preemption with chunked prefill;
the head split; clear errors for sizes that cannot work; and worker lifetimes -- no process outlives the
engine after a normal exit, an exception or Ctrl-C, and a worker that dies ends the run with an error naming it
instead of a hang (each checked in a subprocess that runs ``tests/models/tp_lifecycle_script.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.tp.runner import check_parallel_resources
from nanovllm.models.parallel import head_shard
from tests.conftest import PARITY_MAX_TOKENS

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "tp_lifecycle_script.py"
GREEDY = SamplingParams(temperature=0, max_tokens=PARITY_MAX_TOKENS)


# -- the split and its limits (no processes) ---------------------------------------------------------------------

def test_kv_heads_are_dealt_out_evenly_with_their_query_heads() -> None:
    # SmolLM2-135M: 9 query heads in 3 KV groups of 3.
    shards = [head_shard(9, 3, rank, 2) for rank in range(2)]
    assert [(s.kv_start, s.num_kv_heads, s.q_start, s.num_heads) for s in shards] == [(0, 2, 0, 6), (2, 1, 6, 3)]
    shards = [head_shard(32, 8, rank, 4) for rank in range(4)]
    assert [(s.kv_start, s.num_kv_heads, s.num_heads) for s in shards] == [(0, 2, 8), (2, 2, 8), (4, 2, 8), (6, 2, 8)]


def test_sizes_that_cannot_work_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) must be <= the model's num_key_value_heads"):
        head_shard(9, 3, 0, 4)
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads"):
        head_shard(10, 3, 0, 1)
    cores = os.cpu_count() or 1
    with pytest.raises(ValueError, match=f"needs one CPU core per worker but this machine has {cores}"):
        check_parallel_resources(cores + 1, "cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(tensor_parallel_size=0)
    # Through the engine, before any worker starts: the default model has 3 KV heads.
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LLM(tensor_parallel_size=4, num_kv_blocks=64, max_model_len=512)


def test_column_parallel_slices_plain_and_fused_projections() -> None:
    import torch
    from torch import nn

    from nanovllm.models.parallel import ColumnParallelLinear

    full = nn.Linear(4, 12)
    x = torch.randn(3, 4)
    # A fused [q | k | v]-style projection: this rank's rows of each part, fused again in order.
    shard = ColumnParallelLinear(full, 0, 2, also=[(4, 6), (8, 10)])
    # Same sums; a narrower matmul may block them differently, so equal up to float rounding.
    torch.testing.assert_close(shard(x), full(x)[:, [0, 1, 4, 5, 8, 9]])
    torch.testing.assert_close(ColumnParallelLinear(full, 6, 12)(x), full(x)[:, 6:])


# -- parity ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp2():
    engine = LLM(tensor_parallel_size=2, num_kv_blocks=1024, max_model_len=1024)
    yield engine
    engine.engine.runner.close()


def _greedy(llm: LLM, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_tp2_greedy_equals_tp1(tp2, llm, parity_prompts, hf_greedy) -> None:
    assert _greedy(tp2, parity_prompts) == _greedy(llm, parity_prompts) == hf_greedy


def test_tp2_parity_under_preemption_and_chunked_prefill(llm, parity_prompts, hf_greedy) -> None:
    # The 13 prompts of at most 43 tokens (test_tp2_greedy_equals_tp1 runs all of them): a cache sized to the
    # 227-261-token chats spends most of the run re-prefilling them after each preemption, 32 tokens a step.
    order = sorted((i for i, p in enumerate(parity_prompts) if len(p) < 100), key=lambda i: len(parity_prompts[i]))
    block_size = 4
    # Room for the longest request and a dozen blocks more: the others preempt each other (15 times).
    num_blocks = -(-(max(len(parity_prompts[i]) for i in order) + PARITY_MAX_TOKENS) // block_size) + 12
    engine = LLM(tensor_parallel_size=2, block_size=block_size, num_kv_blocks=num_blocks,
                 max_num_batched_tokens=32, max_model_len=1024)
    try:
        assert _greedy(engine, [parity_prompts[i] for i in order]) == [hf_greedy[i] for i in order]
        steps = engine.last_steps
        assert sum(s["num_preempted"] for s in steps) >= 5
        assert max(s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps) <= 32
    finally:
        engine.engine.runner.close()


# -- lifetimes -------------------------------------------------------------------------------------------------------

def _start(mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(SCRIPT), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _worker_pids(proc: subprocess.Popen) -> list[int]:
    line = proc.stdout.readline()
    assert line.startswith("worker pids:"), line + proc.stderr.read()[-3000:]
    return [int(pid) for pid in line.split(":")[1].split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too (it only waits for its parent to read its status).
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ", 1)[1].startswith("Z"))


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), f"orphan workers: {[p for p in pids if _alive(p)]}"


@pytest.mark.parametrize("mode, status, message", [
    ("normal", 0, None),
    ("exception", 1, "RuntimeError: user code failed"),
])
def test_workers_end_with_the_engine(mode, status, message) -> None:
    proc = _start(mode)
    pids = _worker_pids(proc)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == status, err[-3000:]
    assert (message or "done") in (err if message else out)
    _assert_gone(pids)


def test_ctrl_c_stops_the_driver_and_its_workers() -> None:
    # Whatever SIGINT disposition this test process inherited (ignored, in a suite run started in the
    # background), the script restores Python's Ctrl-C -> KeyboardInterrupt before it starts its workers.
    proc = _start("sigint")
    try:
        pids = _worker_pids(proc)
        assert proc.stdout.readline().strip() == "generating"
        time.sleep(1.0)  # into the generation, which takes far longer (4 x 400 tokens on 2 CPU ranks)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # a failure above must not leave the driver (and so its workers) running
            proc.kill()
            proc.communicate()
    assert "done" not in out, "the generation finished before the signal arrived"
    # Python ends a process whose KeyboardInterrupt is not caught by dying of SIGINT itself (status -2).
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, (proc.returncode, err[-3000:])
    _assert_gone(pids)


@pytest.mark.parametrize("mode", ["kill_worker", "kill_mid_step"])
def test_a_dead_worker_ends_the_run_with_an_error_naming_it(mode) -> None:
    proc = _start(mode)
    (pid,) = _worker_pids(proc)
    _, err = proc.communicate(timeout=240)  # a hang fails here
    assert proc.returncode == 1
    assert f"WorkerDiedError: tensor-parallel worker rank 1 (pid {pid}) exited with status -9" in err, err[-3000:]


def test_a_script_without_the_main_guard_gets_one_error_naming_it(tmp_path) -> None:
    """A script that builds a tensor-parallel engine at its top level: each spawned worker imports it again and
    would build one too. The worker stops at once and the script gets one RuntimeError naming the fix, not a
    WorkerDiedError under multiprocessing's bootstrapping message."""
    script = tmp_path / "unguarded.py"
    script.write_text("from nanovllm import LLM\n\nLLM(tensor_parallel_size=2, num_kv_blocks=64, max_model_len=256, "
                      "warmup=False)\nprint('built')\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1 and "built" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: tensor_parallel_size > 1 starts worker processes") and \
        'if __name__ == "__main__":' in last, proc.stderr[-3000:]
    assert "WorkerDiedError" not in proc.stderr and "bootstrapping phase" not in proc.stderr
