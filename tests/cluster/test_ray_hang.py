"""A real replica that hangs (its actor stops answering in the middle of a step) is treated as dead after
``cluster.step_timeout``: its actor is killed, its requests resume on the live replica and finish, the records
say so, and no Ray process is left after the run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO
from helpers import ray_processes
from test_ray_cluster import synthetic, tiny_model  # noqa: F401 -- a fixture

ray = pytest.importorskip("ray")

# The first replica process to schedule anything takes the lock file and sleeps: a hang, as a stuck kernel or a
# deadlock would be. Every other process schedules first-come first-served.
HANG_PLUGIN = """
import os, time
from nanovllm import Policy, register_policy

@register_policy("hang_once")
class HangOnce(Policy):
    def priority(self, request, now):
        try:
            os.close(os.open({lock!r}, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return request.arrival_time
        time.sleep(3600)
"""


def test_a_replica_that_stops_stepping_is_killed_after_the_step_timeout_and_its_requests_resume(tmp_path, tiny_model):
    from nanovllm.serving.records import read_jsonl, read_metrics

    (tmp_path / "hang.py").write_text(HANG_PLUGIN.format(lock=str(tmp_path / "hung.lock")))
    before = {p.pid for p in ray_processes()}
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "nanovllm.run", "cluster.replicas=2", f"plugins=[{tmp_path / 'hang.py'}]",
         "cluster.step_timeout=5", f"model.path={tiny_model}", "scheduler.name=hang_once", "router=round_robin",
         *synthetic(6, 8), "engine.num_kv_blocks=128", "engine.max_model_len=512", "engine.warmup=false",
         "engine.dtype=float32", "monitor.calibrate=false", "progress=false", f"hydra.run.dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    requests = read_jsonl(run_dir / "requests.jsonl")
    assert len(requests) == 6 and all(r["error"] is None and r["num_output_tokens"] == 8 for r in requests)
    moved = [r for r in requests if r["num_retries"]]
    assert moved and len({r["retried_from"][0] for r in moved}) == 1
    (hung,) = {r["retried_from"][0] for r in moved}
    assert all(r["replica"] != hung for r in requests)
    assert read_metrics(run_dir)["faults"]["retried_requests"] == len(moved)
    assert not [p for p in ray_processes() if p.pid not in before]
