"""Chaos on a real cluster (issue 59): ``python -m nanovllm.serve`` on a tiny model (float32) on 127.0.0.1 with
two colocated replicas, or a prefill/decode pair, greedy streams from the openai SDK, and a random replica's Ray
actor SIGKILLed every few seconds while they run (each time both replicas are up again: ``cluster.max_restarts``
relaunches the dead one), twice, the clients sending streams until both kills landed. Every request ends exactly
once, finished with the text of an undisturbed in-process run (each token once: no duplicate, no gap) or failed
with its reason; none is lost from the run's records; no Ray daemon or replica process is left after the server
exits."""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import ray_processes
from test_ray_cluster import tiny_model  # noqa: F401 -- a fixture
from test_ray_faults import replica_actor_processes

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
           "The three primary colors are", "import numpy as np\n", "My favourite food is", "In 1969, the first"]
# Long streams of the tiny model (each relaunch loads it in a second, where the default model took many): a
# stream lasts about as long as the default model's 24 tokens did, so kills land while streams run.
MAX_TOKENS = 320
KILL_EVERY_S = 3.0
# Two random kills, each relaunched: the second one lands once the first victim's relaunch is up, so it may hit
# a relaunched actor. (Each kill-and-relaunch cycle adds seconds, the relaunched actor loading the model again.)
MAX_RESTARTS = 2
MAX_ROUNDS = 40   # bounds a client's streams should the kills never land (the test then fails on the count)
ENGINE = ["engine.num_kv_blocks=256", "engine.max_model_len=512", "engine.warmup=false", "engine.dtype=float32"]


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[str]:
    """Each prompt's text from an undisturbed in-process greedy float32 run."""
    from nanovllm import LLM, SamplingParams

    reference = LLM(model=str(tiny_model), dtype="float32", num_kv_blocks=256, max_model_len=512, warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = [out.text for out in reference.generate(PROMPTS, params, use_tqdm=False)]
    reference.close()
    return texts


@dataclass
class Chaos:
    """What one chaos run saw: per request (request ``i`` is prompt ``i % len(PROMPTS)``; ``i`` counts the
    streams in the order the clients opened them) its chunks and outcome, the actors killed and every actor
    process seen."""

    chunks: list[list[str]] = field(default_factory=list)
    outcomes: list[tuple[str, str | None]] = field(default_factory=list)
    kills: list[int] = field(default_factory=list)
    actor_pids: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def open_request(self) -> int:
        """The next request's index, its chunks and (until it ends) "lost" outcome recorded."""
        with self.lock:
            self.chunks.append([])
            self.outcomes.append(("lost", None))
            return len(self.chunks) - 1

    @property
    def num_requests(self) -> int:
        return len(self.outcomes)

    @property
    def num_finished(self) -> int:
        return sum(outcome == "finished" for outcome, _ in self.outcomes)


def run_chaos(tmp_path: Path, overrides: list[str], streams: int, rounds: int) -> tuple[Chaos, Path]:
    """Serve with ``overrides`` (the cluster's shape) and run ``streams`` client threads, each sending streams
    one after another, at least ``rounds`` of them and more until ``MAX_RESTARTS`` kills landed (so every kill
    hits running streams on any machine load), while a random replica's actor is SIGKILLed every
    ``KILL_EVERY_S`` whenever both replicas are up (at most ``MAX_RESTARTS`` times); the server then stops with
    SIGINT. Returns what the clients saw and the run directory."""
    import openai

    from helpers import cli_env, free_port, interrupt_server, wait_until_healthy

    port, run_dir = free_port(), tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanovllm.serve", *overrides, f"cluster.max_restarts={MAX_RESTARTS}",
         "cluster.max_retries=8", "router=round_robin", *ENGINE,
         "monitor.calibrate=false", f"server.port={port}", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    seen = Chaos()
    done = threading.Event()
    try:
        wait_until_healthy(proc, url, timeout=240)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=240, max_retries=0)
        model = client.models.list().data[0].id

        def stream(i: int) -> None:
            try:
                for chunk in client.completions.create(model=model, prompt=PROMPTS[i % len(PROMPTS)],
                                                       max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                                                       extra_body={"ignore_eos": True}):
                    seen.chunks[i].append(chunk.choices[0].text)
                    if chunk.choices[0].finish_reason is not None:
                        seen.outcomes[i] = ("finished", chunk.choices[0].finish_reason)
            except openai.APIError as exc:   # failed mid-stream (an error event) or at once: the reason
                seen.outcomes[i] = ("failed", str(exc))

        def client_thread() -> None:
            # Its rounds one after another; past ``rounds``, more while a kill is still to come (the kills are
            # what the test is about: a run that ended before them would prove nothing).
            for done_rounds in range(MAX_ROUNDS):
                if done_rounds >= rounds and len(seen.kills) >= MAX_RESTARTS:
                    return
                stream(seen.open_request())

        def chaos() -> None:
            # A random replica's actor is SIGKILLed every few seconds, each time both are up (a relaunch loads
            # the model again), until every stream ended.
            rng = random.Random(0)
            while not done.wait(KILL_EVERY_S):
                actors = replica_actor_processes(proc.pid)
                seen.actor_pids.update(p.pid for p in actors)
                if len(actors) == 2 and len(seen.kills) < MAX_RESTARTS and any(seen.chunks):
                    victim = rng.choice(actors)
                    victim.send_signal(signal.SIGKILL)
                    seen.kills.append(victim.pid)

        killer = threading.Thread(target=chaos, daemon=True)
        killer.start()
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            for future in [pool.submit(client_thread) for _ in range(streams)]:
                future.result(timeout=600)
        done.set()
        killer.join(30)
    finally:
        done.set()
        out, err = interrupt_server(proc)
    assert proc.returncode == 130, err[-3000:]
    return seen, run_dir


def check_chaos(seen: Chaos, run_dir: Path, expected: list[str], ray_before: set[int]) -> list[dict]:
    """What every chaos run must show: every request ended, finished with the undisturbed text (each token
    once) or failed with a reason; the run's records hold every request and agree with the clients; no Ray
    daemon or replica process is left. Returns the records."""
    import psutil

    from nanovllm.serving.records import read_run

    assert len(seen.kills) == MAX_RESTARTS, f"{len(seen.kills)} replicas killed while the streams ran"
    for i, (outcome, detail) in enumerate(seen.outcomes):
        assert outcome != "lost", f"stream {i} ended without a finish reason or an error"
        if outcome == "finished":
            assert detail == "length" and "".join(seen.chunks[i]) == expected[i % len(PROMPTS)], i
        else:
            assert detail and ("died" in detail or "replica" in detail), detail

    run = read_run(run_dir)
    assert len(run.requests) == seen.num_requests
    assert sorted(len(r["token_times"]) for r in run.requests if r["error"] is None) == \
        [MAX_TOKENS] * seen.num_finished
    assert all((r["error"] is None) == (r["finish_reason"] == "length") for r in run.requests)
    assert all("died" in r["error"] or "replica" in r["error"] for r in run.requests if r["error"] is not None)

    assert not [p for p in ray_processes() if p.pid not in ray_before]
    alive = [pid for pid in seen.actor_pids if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"replica processes left: {alive}"
    return run.requests


def test_streams_over_http_survive_replicas_killed_at_random_every_few_seconds(tmp_path, expected, tiny_model):
    before = {p.pid for p in ray_processes()}
    seen, run_dir = run_chaos(tmp_path, ["cluster.replicas=2", f"model.path={tiny_model}"], streams=len(PROMPTS),
                              rounds=1)
    records = check_chaos(seen, run_dir, expected, before)
    assert seen.num_finished >= len(PROMPTS) // 2
    assert any(r["num_retries"] >= 1 for r in records), "no request was re-routed"
    from nanovllm.serving.records import read_run
    assert read_run(run_dir).metrics["faults"]["replica_restarts"] >= 1


def test_a_prefill_decode_pair_over_http_survives_either_replica_killed_at_random(tmp_path, expected, tiny_model):
    """One prefill and one decode replica; four clients send two streams or more each, one after the other, so
    requests arrive while a replica is dead too. With one replica per pool, a death leaves its pool empty until
    the relaunch: what it held, what arrives for it meanwhile and (a decode replica) the hand-offs wait for the
    relaunched actor, then finish with the undisturbed text; all of them decode on replica 1."""
    before = {p.pid for p in ray_processes()}
    seen, run_dir = run_chaos(tmp_path, ["cluster.prefill_replicas=1", "cluster.decode_replicas=1",
                                         f"model.path={tiny_model}"], streams=4, rounds=2)
    records = check_chaos(seen, run_dir, expected, before)
    assert seen.num_finished >= seen.num_requests // 2, seen.outcomes
    assert {r["replica"] for r in records if r["error"] is None} == {1}
    from nanovllm.serving.records import read_run
    faults = read_run(run_dir).metrics["faults"]
    assert faults["replica_deaths"] >= 1 and faults["replica_restarts"] >= 1
