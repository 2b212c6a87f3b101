"""Faults on real replicas: a Ray actor killed mid-generation has its requests re-routed to the live replica,
where they resume from their prompt plus the tokens already generated (recomputed) and end with what one
undisturbed engine generates (greedy, float32), each token seen once by the driver; the records say they were
retried and from where; the dead replica is relaunched (``cluster.max_restarts``) and a later request is routed
to it; with no replica alive requests wait for a relaunch, and fail with the reason when none is left; no Ray
process is left after close. One module cluster (2 replicas, one restart each), the tests in order: the last one
uses up both replicas."""

from __future__ import annotations

import os
import time

import pytest

from helpers import ray_processes
from test_ray_cluster import PROMPTS, tiny_engine, tiny_model  # noqa: F401 -- fixtures

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

# The module cluster runs the default model: its kills are timed by the driver while the replicas step ahead of
# it, and the default model's steps keep those races far apart (the HTTP test below runs the tiny model).
ENGINE = dict(num_kv_blocks=256, max_model_len=512, warmup=False)


@pytest.fixture(scope="module")
def faulty_llm():
    from nanovllm import LLM

    before = {p.pid for p in ray_processes()}
    llm = LLM(cluster=dict(replicas=2, max_retries=2, max_restarts=1), router="round_robin", dtype="float32",
              **ENGINE)
    yield llm
    llm.close()
    assert not ray.is_initialized()
    assert not [p for p in ray_processes() if p.pid not in before]


def drive(cluster, requests, kill=None, timeout=300.0):
    """Add ``requests`` at once and step until all ended; ``kill(output)`` after each step may kill replicas.
    Checks at every step that each request's driver-side output only grows (what a streaming server sends on)
    and returns the ended requests."""
    for request in requests:
        cluster.add_request(request)
    seen = {r.request_id: [] for r in requests}
    ended = []
    deadline = time.monotonic() + timeout
    while cluster.has_unfinished():
        assert time.monotonic() < deadline, "the cluster did not finish in time"
        if not cluster.wait_for_step(0.1):
            continue
        output = cluster.step()
        ended += output.finished
        for request in requests:
            now = list(request.output_token_ids)
            before = seen[request.request_id]
            assert now[:len(before)] == before, f"request {request.request_id}'s tokens changed: no duplicate, no gap"
            seen[request.request_id] = now
        if kill is not None:
            kill(output)
    return ended


def test_a_killed_replicas_requests_resume_elsewhere_with_the_undisturbed_output_and_it_restarts(faulty_llm):
    from nanovllm import LLM, SamplingParams
    from nanovllm.serving.records import request_record

    cluster = faulty_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = [o.token_ids for o in LLM(dtype="float32", **ENGINE).generate(PROMPTS, params, use_tqdm=False)]
    requests = [cluster.make_request(p, params) for p in PROMPTS]
    killed: list[dict] = []

    def kill(output):
        # Replica 1 dies once each of its requests has a few tokens out (mid-generation, not at its start).
        on_one = [r for r in requests if r.replica == 1 and not r.is_finished]
        if not killed and on_one and all(r.num_output_tokens >= 4 for r in on_one):
            killed.append({r.request_id: r.num_output_tokens for r in on_one})
            cluster.kill_replica(1)

    ended = drive(cluster, requests, kill)
    assert killed and sorted(r.request_id for r in ended) == sorted(r.request_id for r in requests)
    assert [r.output_token_ids for r in requests] == expected
    assert all(r.error is None and r.finish_reason == "length" for r in requests)
    records = {r.request_id: request_record(r, 0.0) for r in requests}
    moved = killed[0]
    for request_id, record in records.items():
        if request_id in moved:   # resumed on replica 0: its prompt and every token but the newest recomputed
            assert record["num_retries"] == 1 and record["retried_from"] == [1] and record["replica"] == 0
            assert record["retry_recomputed_tokens"] >= record["num_prompt_tokens"] + moved[request_id] - 1
        else:
            assert record["num_retries"] == 0 and record["retried_from"] == [] and record["retry_recomputed_tokens"] == 0
        assert len(record["token_times"]) == 32 and record["token_times"] == sorted(record["token_times"])
        assert record["first_token_time"] == record["token_times"][0]
    # The relaunched replica 1 rejoins the router and serves again.
    replica = cluster.replicas[1]
    assert replica.num_restarts == 1
    deadline = time.monotonic() + 300
    while not replica.alive and time.monotonic() < deadline:
        cluster.poll_restarts(timeout=1.0)
    assert replica.alive
    later = [cluster.make_request(p, SamplingParams(temperature=0.0, max_tokens=8)) for p in PROMPTS[:2]]
    drive(cluster, later)
    assert {r.replica for r in later} == {0, 1} and all(r.error is None for r in later)
    assert [r.output_token_ids for r in later] == [e[:8] for e in expected[:2]]


def test_with_no_replica_alive_requests_wait_for_a_relaunch_and_fail_with_the_reason_once_none_is_left(faulty_llm):
    """Both replicas die at once (replica 1 has used its one restart, replica 0 has one left): no replica is
    alive, so the requests they held wait for replica 0's relaunch and finish there with the undisturbed output.
    Once replica 0 dies for good, what it held fails saying no replica is left, and an arrival fails with the
    reason (before, the router's "no live replica" error escaped ``add_request`` and stopped a serving loop)."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.cluster.cluster import NO_LIVE_REPLICA

    cluster = faulty_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in LLM(dtype="float32", **ENGINE).generate(PROMPTS, params, use_tqdm=False)]
    requests = [cluster.make_request(p, params) for p in PROMPTS]
    killed = []

    def kill(output):
        if not killed and all(r.num_output_tokens >= 2 for r in requests):
            killed.append(True)
            cluster.kill_replica(0)
            cluster.kill_replica(1)

    drive(cluster, requests, kill)
    assert killed and all(r.error is None and r.finish_reason == "length" for r in requests)
    assert [r.output_token_ids for r in requests] == expected
    assert all(r.replica == 0 and r.num_retries >= 1 for r in requests)
    assert [r.num_restarts for r in cluster.replicas] == [1, 1]
    assert cluster.replicas[0].alive and not cluster.replicas[1].alive

    cluster.kill_replica(0)
    held = cluster.make_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=4))
    drive(cluster, [held])
    assert held.error is not None and held.error.startswith("replica 0 died: ")
    assert held.error.endswith("(no live replica is left to retry it on)")
    after = cluster.make_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=4))
    assert drive(cluster, [after]) == [after]
    assert after.status.name == "FAILED" and after.error == NO_LIVE_REPLICA and after.num_output_tokens == 0


def replica_actor_processes(root: int) -> list:
    """The Ray worker processes of ``root``'s ReplicaActors (Ray titles them ``ray::ReplicaActor...``)."""
    import psutil

    found = []
    for proc in psutil.Process(root).children(recursive=True):
        try:
            text = " ".join(proc.cmdline()) + " " + proc.name()
        except psutil.Error:
            continue
        if "ray::ReplicaActor" in text:
            found.append(proc)
    return found


def test_streams_over_http_survive_a_replica_killed_mid_stream(tmp_path, tiny_model, tiny_engine):
    """``python -m nanovllm.serve cluster.replicas=2 cluster.max_restarts=1``, four concurrent greedy streams from
    the openai SDK, one replica's actor process SIGKILLed once every stream has text: each stream's text is the
    undisturbed one (no duplicate, no gap), the run's records say which requests were retried, and no Ray
    process is left after SIGINT."""
    import concurrent.futures
    import signal
    import subprocess
    import sys
    import threading

    import openai

    from helpers import cli_env, free_port, interrupt_server, wait_until_healthy
    from nanovllm import LLM, SamplingParams
    from nanovllm.serving.records import read_run

    max_tokens = 300
    engine = LLM(dtype="float32", **tiny_engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    expected = [out.text for out in engine.generate(PROMPTS, params, use_tqdm=False)]
    engine.close()
    before = {p.pid for p in ray_processes()}
    port, run_dir = free_port(), tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanovllm.serve", "cluster.replicas=2", "cluster.max_restarts=1",
         "router=round_robin", f"model.path={tiny_model}", "engine.num_kv_blocks=128", "engine.max_model_len=512",
         "engine.warmup=false", "engine.dtype=float32", "monitor.calibrate=false", f"server.port={port}",
         f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    chunks: list[list[str]] = [[] for _ in PROMPTS]
    everyone_started = threading.Event()
    try:
        wait_until_healthy(proc, url, timeout=300)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300, max_retries=0)
        model = client.models.list().data[0].id

        def stream(i: int) -> str:
            for chunk in client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=max_tokens,
                                                   temperature=0.0, stream=True, extra_body={"ignore_eos": True}):
                chunks[i].append(chunk.choices[0].text)
                if all(len(c) >= 2 for c in chunks):
                    everyone_started.set()
            return "".join(chunks[i])

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(stream, i) for i in range(len(PROMPTS))]
            assert everyone_started.wait(120), "the streams did not start"
            actors = replica_actor_processes(proc.pid)
            assert len(actors) == 2
            actors[0].send_signal(signal.SIGKILL)
            texts = [future.result() for future in futures]
        assert texts == expected
    finally:
        out, err = interrupt_server(proc)
    assert proc.returncode == 130, err[-3000:]
    run = read_run(run_dir)
    assert len(run.requests) == len(PROMPTS) and all(r["error"] is None for r in run.requests)
    retried = [r for r in run.requests if r["num_retries"]]
    assert retried and all(r["num_retries"] == 1 for r in retried)
    assert len({r["retried_from"][0] for r in retried}) == 1   # all from the one replica killed
    assert all(r["num_output_tokens"] == max_tokens and len(r["token_times"]) == max_tokens for r in run.requests)
    assert run.metrics["faults"]["retried_requests"] == len(retried)
    assert run.metrics["faults"]["replica_restarts"] == 1   # relaunched (cluster.max_restarts=1)
    assert not [p for p in ray_processes() if p.pid not in before]
