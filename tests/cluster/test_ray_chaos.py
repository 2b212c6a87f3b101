"""Chaos on a real cluster (issue 59): ``python -m nanovllm.serve cluster.replicas=2`` on the default model
(float32) on 127.0.0.1, eight concurrent greedy streams from the openai SDK, and a random replica's Ray actor
SIGKILLed every few seconds while they run (each time both replicas are up again: ``cluster.max_restarts``
relaunches the dead one). Every request ends exactly once, finished with the text of an undisturbed in-process
run (each token once: no duplicate, no gap) or failed with its reason; none is lost from the run's records; no
Ray daemon or replica process is left after the server exits."""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from test_ray_cluster import ray_processes
from test_ray_faults import replica_actor_processes

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
           "The three primary colors are", "import numpy as np\n", "My favourite food is", "In 1969, the first"]
MAX_TOKENS = 40
KILL_EVERY_S = 3.0
MAX_RESTARTS = 4
ENGINE = ["engine.num_kv_blocks=256", "engine.max_model_len=512", "engine.warmup=false", "engine.dtype=float32"]


def test_streams_over_http_survive_replicas_killed_at_random_every_few_seconds(tmp_path):
    import openai

    from helpers import cli_env, free_port, interrupt_server, wait_until_healthy
    from nanovllm import LLM, SamplingParams
    from nanovllm.serving.records import read_run

    started = time.monotonic()
    reference = LLM(dtype="float32", num_kv_blocks=256, max_model_len=512, warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [out.text for out in reference.generate(PROMPTS, params, use_tqdm=False)]
    reference.close()
    del reference

    before = {p.pid for p in ray_processes()}
    port, run_dir = free_port(), tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanovllm.serve", "cluster.replicas=2", f"cluster.max_restarts={MAX_RESTARTS}",
         "cluster.max_retries=8", "router=round_robin", *ENGINE,
         "monitor.calibrate=false", f"server.port={port}", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    chunks: list[list[str]] = [[] for _ in PROMPTS]
    outcomes: list[tuple[str, str | None]] = [("lost", None)] * len(PROMPTS)
    kills: list[int] = []
    actor_pids: set[int] = set()
    done = threading.Event()
    try:
        wait_until_healthy(proc, url, timeout=240)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=240, max_retries=0)
        model = client.models.list().data[0].id

        def stream(i: int) -> None:
            try:
                for chunk in client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                                                       temperature=0.0, stream=True,
                                                       extra_body={"ignore_eos": True}):
                    chunks[i].append(chunk.choices[0].text)
                    if chunk.choices[0].finish_reason is not None:
                        outcomes[i] = ("finished", chunk.choices[0].finish_reason)
            except openai.APIError as exc:   # failed mid-stream: the error event names the reason
                outcomes[i] = ("failed", str(exc))

        def chaos() -> None:
            # A random replica's actor is SIGKILLed every few seconds, each time both are up (a relaunch loads
            # the model again), until every stream ended.
            rng = random.Random(0)
            while not done.wait(KILL_EVERY_S):
                actors = replica_actor_processes(proc.pid)
                actor_pids.update(p.pid for p in actors)
                if len(actors) == 2 and len(kills) < MAX_RESTARTS and any(chunks):
                    victim = rng.choice(actors)
                    victim.send_signal(signal.SIGKILL)
                    kills.append(victim.pid)

        killer = threading.Thread(target=chaos, daemon=True)
        killer.start()
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            for future in [pool.submit(stream, i) for i in range(len(PROMPTS))]:
                future.result(timeout=240)
        done.set()
        killer.join(30)
    finally:
        done.set()
        out, err = interrupt_server(proc)
    assert proc.returncode == 130, err[-3000:]
    assert kills, "no replica was killed while the streams ran"

    # every request ended: finished with the undisturbed text, each token once, or failed with a reason
    for i, (outcome, detail) in enumerate(outcomes):
        assert outcome != "lost", f"stream {i} ended without a finish reason or an error"
        if outcome == "finished":
            assert detail == "length" and "".join(chunks[i]) == expected[i], i
        else:
            assert detail and ("died" in detail or "replica" in detail), detail
    assert sum(o == "finished" for o, _ in outcomes) >= len(PROMPTS) // 2

    # none lost from the run's records, which agree with what the clients saw
    run = read_run(run_dir)
    assert sorted(len(r["token_times"]) for r in run.requests if r["error"] is None) == \
        [MAX_TOKENS] * sum(o == "finished" for o, _ in outcomes)
    assert len(run.requests) == len(PROMPTS)
    assert all((r["error"] is None) == (r["finish_reason"] == "length") for r in run.requests)
    assert any(r["num_retries"] >= 1 for r in run.requests), "no request was re-routed"
    assert run.metrics["faults"]["replica_restarts"] >= 1

    # nothing left behind: no Ray daemon, no replica actor process
    assert not [p for p in ray_processes() if p.pid not in before]
    import psutil
    alive = [pid for pid in actor_pids if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"replica processes left: {alive}"
    assert time.monotonic() - started < 300
