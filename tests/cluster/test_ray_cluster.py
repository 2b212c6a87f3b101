"""Real replicas on Ray: two engines in Ray actors behind a router, driven like one engine (one module-scoped
cluster, float32, a tiny model, no warm-up, to keep the file cheap). The cluster generates what one engine does, its views
follow the replicas' reported state (the prefix-cache mirror agrees with each replica's own allocator), a
served run writes where each request and step ran, a replica killed mid-run (retries off) fails its requests
with the reason and the router then sends every request to the live one, and no Ray process is left once it is
closed."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, interrupt_server, ray_processes

from nanovllm.config import torch_dtype

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # as RayCluster sets it: Ray on 127.0.0.1 only
ray = pytest.importorskip("ray")

ENGINE = dict(num_kv_blocks=256, max_model_len=512, warmup=False)
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
LONG = ("You are a helpful assistant. Answer every question briefly and precisely, citing what you know. " * 3)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for a module's in-process clusters, started as ``RayCluster`` starts its own (so
    each cluster reuses it, not starting and stopping Ray, ~5 s each on one core); stopped after the module, which
    must leave no Ray process. A cluster closed on it stops its actors only (``cluster_llm`` checks that a
    cluster which started Ray stops it)."""
    from nanovllm.cluster.ray_replicas import _start_ray

    before = {p.pid for p in ray_processes()}
    assert _start_ray(None, 2), "Ray is already initialized in this process"
    yield
    ray.shutdown()
    assert not [p for p in ray_processes() if p.pid not in before]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama with SmolLM2's tokenizer: the command-line runs below test the cluster's ends (Ctrl-C, a
    plugin that raises), not the model, and load it in every replica in a second."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import save_tiny_model
    from nanovllm.models.loader import resolve_model

    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model(LlamaConfig, LlamaForCausalLM, {}, path, resolve_model(None))
    return path


@pytest.fixture(scope="module")
def tiny_engine(tiny_model) -> dict:
    """``ENGINE`` on the tiny model: the in-process clusters test how replicas cooperate, which does not depend
    on the model, and each replica's actor loads it in a fraction of the default model's time."""
    return dict(ENGINE, model=str(tiny_model))


@pytest.fixture(scope="module")
def cluster_llm(tiny_engine):
    from nanovllm import LLM

    before = {p.pid for p in ray_processes()}
    llm = LLM(cluster=dict(replicas=2), router="round_robin", allocator="prefix", **tiny_engine)
    yield llm
    llm.close()
    assert not ray.is_initialized()
    assert not [p for p in ray_processes() if p.pid not in before]


def test_two_replicas_generate_what_one_engine_does(cluster_llm, tiny_engine):
    from nanovllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12)
    served = cluster_llm.generate(PROMPTS, params, use_tqdm=False)
    alone = LLM(allocator="prefix", **tiny_engine).generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in served] == [o.token_ids for o in alone]
    assert [o.text for o in served] == [o.text for o in alone]
    assert [o.finish_reason for o in served] == [o.finish_reason for o in alone]
    assert [replica.num_routed for replica in cluster_llm.engine.replicas] == [2, 2]   # round robin: both served


def test_views_follow_each_replicas_state_and_its_prefix_cache(cluster_llm):
    from nanovllm import SamplingParams

    cluster = cluster_llm.engine
    [out] = cluster_llm.generate([LONG], SamplingParams(max_tokens=2), use_tqdm=False)
    probe = cluster.make_request(out.prompt_token_ids, SamplingParams(max_tokens=2))
    views = [replica.view(probe, cluster._prefix_match) for replica in cluster.replicas]
    own = ray.get([replica.actor.cached_prefix_len.remote(probe.token_ids) for replica in cluster.replicas])
    assert [view.prefix_match_tokens for view in views] == own       # the mirror is the allocator's answer
    assert max(own) >= len(probe.token_ids) // 16 * 16 - 16 > 0      # one replica caches the prompt's blocks
    assert all(v.num_outstanding == 0 and v.num_free_blocks == v.num_total_blocks == 256 for v in views)
    # A view built anew (no cached view, no cached keys) for a 100-block prompt reads the same mirror.
    from nanovllm import Request

    long = Request("long", list(out.prompt_token_ids) * 25, SamplingParams(max_tokens=1), 0.0)
    for replica in cluster.replicas:
        replica._view = None
    cluster._last_keys = (None, [])
    assert max(replica.view(long, cluster._prefix_match).prefix_match_tokens for replica in cluster.replicas) == \
        max(own)   # the prompt's first repetition is cached; the rest is not


def test_a_served_run_records_where_each_request_and_step_ran(cluster_llm, tmp_path):
    from nanovllm.harness.cluster import ServedCluster
    from nanovllm.serving.loggers import JsonlLogger
    from nanovllm.serving.monitor import ModelCost
    from nanovllm.serving.records import read_run
    from nanovllm.harness.serving import WallClock
    from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, generate_workload

    cluster = cluster_llm.engine
    served = ServedCluster(cluster, WallClock(), ModelCost.from_hf_config(cluster.hf_config, torch_dtype(cluster.config.dtype)), [])
    workload = generate_workload(SyntheticWorkloadConfig(
        num_requests=6, request_rate=20.0, seed=1, input_len=LengthDist(kind="uniform", mean=24, range_ratio=0.5),
        output_len=LengthDist(kind="uniform", mean=4, range_ratio=0.5)), cluster.tokenizer)
    logger = JsonlLogger()
    logger.start(tmp_path, {})
    try:
        result = served.serve(workload, loggers=[logger], progress=False)
    finally:
        logger.finish()
    run = read_run(tmp_path)
    assert sorted(r["request_id"] for r in run.requests) == [str(i) for i in range(6)]
    assert all(r["error"] is None and r["replica"] in (0, 1) for r in run.requests)
    assert {s["replica"] for s in run.steps} == {0, 1} and len(run.steps) == len(result.steps)
    table = result.summary["per_replica"]
    assert sum(row["requests"] for row in table.values()) == 6
    assert sum(row["num_steps"] for row in table.values()) == len(result.steps)
    assert result.summary["cluster_replicas"] == 2 and result.summary["router"] == "round_robin"
    assert result.summary["load_imbalance_mean"] >= 1.0 and set(result.breakdowns["replica"]) == {"0", "1"}


def test_a_killed_replica_fails_its_requests_with_the_reason_and_the_router_avoids_it(cluster_llm):
    """With retries off (``cluster.max_retries=0``; ``test_ray_faults`` tests them), replica 1 is killed
    (ray.kill) once it has run a step of a served run: what it held fails with the reason and the rest finish,
    none is lost; the requests of the next run all go to replica 0 and finish. The second
    run starts after the first has ended, so its arrivals come after the kill on any machine load (a single run
    with timed arrivals once saw replica 1's first step after its last arrival). (Last test of the module
    cluster: it loses a replica.)"""
    from nanovllm.harness.cluster import ServedCluster
    from nanovllm.serving.loggers import RunLogger
    from nanovllm.serving.monitor import ModelCost
    from nanovllm.harness.serving import WallClock
    from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, generate_workload

    from nanovllm import SamplingParams

    cluster = cluster_llm.engine
    cluster.max_retries = 0
    # Both replicas run a step first: a replica's first step loads (in a fresh clone, waits for another worker to
    # build) the attention kernel, which is not what this test is about.
    routed = [replica.num_routed for replica in cluster.replicas]
    cluster_llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [replica.num_routed - before for replica, before in zip(cluster.replicas, routed)] == [1, 1]
    killed = []

    class KillReplicaOne(RunLogger):
        def log_step(self, step):
            if step["replica"] == 1 and not killed:
                cluster.kill_replica(1)
                killed.append(step)

    served = ServedCluster(cluster, WallClock(), ModelCost.from_hf_config(cluster.hf_config, torch_dtype(cluster.config.dtype)), [])

    def burst(seed: int) -> list:
        workload = generate_workload(SyntheticWorkloadConfig(
            num_requests=8, request_rate=float("inf"), seed=seed,
            input_len=LengthDist(kind="uniform", mean=24, range_ratio=0.5),
            output_len=LengthDist(kind="fixed", mean=64)), cluster.tokenizer)   # the tiny model steps fast
        return [dataclasses.replace(w, ignore_eos=True) for w in workload]

    first = served.serve(burst(2), loggers=[KillReplicaOne()], progress=False)
    assert killed and len(first.requests) == 8
    died = [r for r in first.requests if r["error"] is not None]
    assert died and all(r["replica"] == 1 and r["error"].startswith("replica 1 died: ") for r in died)
    assert any(r["replica"] == 0 for r in first.requests)
    assert all(r["finish_reason"] == "length" for r in first.requests if r["error"] is None)
    assert not cluster.replicas[1].alive and cluster.replicas[0].alive
    second = served.serve(burst(3), progress=False)
    assert len(second.requests) == 8
    assert all(r["replica"] == 0 and r["error"] is None and r["finish_reason"] == "length" for r in second.requests)
    assert cluster.replicas[0].alive


def synthetic(num_requests: int, output_len: int) -> list[str]:
    """A synthetic workload for the tiny model (it has no chat template): 16-token prompts, all at t=0."""
    return ["workload=synthetic", f"workload.num_requests={num_requests}", "workload.request_rate=inf",
            "workload.input_len.kind=fixed", "workload.input_len.mean=16", "workload.output_len.kind=fixed",
            f"workload.output_len.mean={output_len}"]


BOOM_PLUGIN = """
from nanovllm import Policy, register_policy

@register_policy("boom")
class Boom(Policy):
    def priority(self, request, now):
        return 1 / 0
"""


def test_a_policy_that_raises_in_a_replica_is_one_error_line_and_leaves_no_ray_process(tmp_path, tiny_model):
    """The exception path: a plugin (loaded in the driver and, from ``plugins``, in every actor) raises inside a
    replica's step; the run ends with the engine's own one-line error, every request that arrived is written,
    and no Ray process is left."""
    from nanovllm.serving.records import read_jsonl

    (tmp_path / "boom.py").write_text(BOOM_PLUGIN)
    before = {p.pid for p in ray_processes()}
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "nanovllm.run", "cluster.replicas=2", f"plugins=[{tmp_path / 'boom.py'}]",
         f"model.path={tiny_model}",
         "scheduler.name=boom", *synthetic(4, 4), "engine.num_kv_blocks=128",
         "engine.max_model_len=512", "engine.warmup=false", "engine.dtype=float32", "monitor.calibrate=false",
         "progress=false", f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert "policy 'boom' raised in priority()" in errors[0] and "ZeroDivisionError" in errors[0]
    requests = read_jsonl(run_dir / "requests.jsonl")
    assert requests and all(r["error"] for r in requests)
    assert not [p for p in ray_processes() if p.pid not in before]


def test_the_command_line_serves_real_replicas_and_ctrl_c_leaves_no_ray_process(tmp_path, tiny_model):
    """``python -m nanovllm.run cluster.replicas=2``, interrupted as a terminal's Ctrl-C does (SIGINT to its whole
    process group, Ray's processes included) once both replicas have stepped: status 130, every request that
    arrived is recorded (finished, or aborted "interrupted"), the per-replica table is printed and written, and
    no Ray process is left."""
    from nanovllm.serving.records import read_jsonl, read_run

    before = {p.pid for p in ray_processes()}
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanovllm.run", "cluster.replicas=2", "router=least_loaded", f"model.path={tiny_model}",
         *synthetic(200, 64), "engine.num_kv_blocks=128",
         "engine.max_model_len=512", "engine.warmup=false", "engine.dtype=float32", "monitor.calibrate=false",
         "progress=false", f"hydra.run.dir={run_dir}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            steps = read_jsonl(run_dir / "steps.jsonl", missing_ok=True)
            if {s["replica"] for s in steps} == {0, 1}:
                break
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted by SIGINT" in err and "load imbalance" in out
    run = read_run(run_dir)
    assert run.requests and run.metrics["unfinished"] == 0 and run.metrics["aborted"] > 0
    assert all(r["finish_reason"] in ("stop", "length") or r["error"] == "interrupted" for r in run.requests)
    assert {r["replica"] for r in run.requests} == {0, 1} and set(run.metrics["per_replica"]) == {"0", "1"}
    assert run.metrics["interrupted"] and run.metrics["router"] == "least_loaded"
    assert not [p for p in ray_processes() if p.pid not in before]


@pytest.mark.parametrize("shape", [["cluster.replicas=2"], ["cluster.prefill_replicas=1", "cluster.decode_replicas=1"]],
                         ids=["colocated", "disaggregated"])
def test_the_server_serves_through_the_router_streams_stops_and_leaves_no_ray_process(tmp_path, tiny_model, shape):
    """``python -m nanovllm.serve cluster.replicas=2 router=round_robin`` (and with a prefill and a decode
    replica), driven by the openai SDK and httpx on loopback: concurrent completions answer what one engine
    generates, spread over both replicas; a stream arrives token by token from the actors; a stop string ends its
    request on its replica ("stop", no text past it); SIGINT exits 130 with the per-replica table written, and
    no Ray process is left."""
    import concurrent.futures

    import httpx
    import openai

    from helpers import cli_env, free_port, wait_until_healthy
    from nanovllm import LLM, SamplingParams
    from nanovllm.serving.records import read_run

    engine = LLM(model=str(tiny_model), dtype="float32", **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [out.text for out in engine.generate(PROMPTS, params, use_tqdm=False)]
    engine.close()
    before = {p.pid for p in ray_processes()}
    port, run_dir = free_port(), tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanovllm.serve", *shape, "router=round_robin",
         f"model.path={tiny_model}", "engine.num_kv_blocks=128", "engine.max_model_len=512", "engine.warmup=false",
         "engine.dtype=float32", "monitor.calibrate=false", f"server.port={port}", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, timeout=300)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        model = client.models.list().data[0].id

        def complete(prompt: str) -> str:
            return client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0.0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(complete, PROMPTS))
        assert texts == expected
        chunks = [c.choices[0].text for c in client.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True})]
        assert len([c for c in chunks if c]) > 1 and "".join(chunks) == expected[0]
        stop = expected[1][len(expected[1]) // 2:][:6]   # a piece of its middle: the reply must end before it
        stopped = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=24, temperature=0.0,
                                            stop=[stop], extra_body={"ignore_eos": True}).choices[0]
        assert stopped.finish_reason == "stop" and stopped.text == expected[1][:expected[1].index(stop)]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'vllm:request_success_total{' in metrics
    finally:
        out, err = interrupt_server(proc)
    assert proc.returncode == 130, err[-3000:]
    assert "load imbalance" in out
    run = read_run(run_dir)
    assert len(run.requests) == len(PROMPTS) + 2
    if len(shape) == 1:
        assert {r["replica"] for r in run.requests} == {0, 1}
    else:   # prefilled on replica 0, decoded on replica 1, the K/V moved for every one
        assert {(r["prefill_replica"], r["replica"]) for r in run.requests} == {(0, 1)}
        assert all(r["kv_transfer_bytes"] > 0 for r in run.requests)
        assert run.metrics["disaggregation"]["handed_off"] == len(PROMPTS) + 2
    assert set(run.metrics["per_replica"]) == {"0", "1"} and run.metrics["router"] == "round_robin"
    assert {s["replica"] for s in run.steps} == {0, 1}
    assert not [p for p in ray_processes() if p.pid not in before]
