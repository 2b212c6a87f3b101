"""Sweeps beyond one process: the same tiny sweep through Hydra's basic, joblib, submitit_local and Ray launchers
gives the same summary (rows, swept settings, the bad combination's error, the good job's counts), each parallel
job runs with its fair share of torch threads, and the Optuna sweeper tunes an engine knob toward the run's
objective with failed trials recorded rather than fatal. The fair-share and objective rules are checked as pure
functions too."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nanovllm.harness.objective import ObjectiveConfig, check_sweeper_direction, objective_value
from nanovllm.harness.parallel_jobs import threads_for_job
from helpers import TINY, ray_processes, run_cli

# What is tested is the launchers and sweepers, not the model: the jobs run the simulator (the same harness, no
# model load and no kernel build in each job's process).
SIMULATED = [*TINY, "runner=sim", "runner.step_time=token_cost"]
# Two jobs: the first is a bad combination (no chunked prefill, yet a token budget below max_model_len).
SWEEP = [*SIMULATED, "engine.enable_chunked_prefill=false", "engine.max_num_batched_tokens=16,512"]
BAD_COMBINATION = "engine.max_num_batched_tokens (16) must be >= max_model_len (512)"


# -- the rules, as pure functions --------------------------------------------------------------------------------

@pytest.mark.parametrize("launcher, cores, threads", [
    ({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}, 8, None),
    ({"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": 2}, 8, 4),
    ({"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": 3}, 2, 1),
    ({"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": -1}, 8, 1),
    ({"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": -2}, 8, 1),
    ({"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher", "cpus_per_task": 6}, 2, 6),
    ({"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher", "cpus_per_task": None}, 8, 1),
    ({"_target_": "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher", "ray": {"remote": {"num_cpus": 3}}}, 8, 3),
    ({"_target_": "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher", "ray": {"remote": {}}}, 8, 1),
])
def test_fair_share_of_threads(launcher, cores, threads) -> None:
    assert threads_for_job(launcher, cores) == threads


def test_joblib_zero_jobs_is_an_error() -> None:
    with pytest.raises(ValueError, match="n_jobs"):
        threads_for_job({"_target_": "JoblibLauncher", "n_jobs": 0}, 4)


def test_objective_reads_the_metric_and_checks_the_sweeper() -> None:
    summary = {"output_throughput": 12.5, "p99_ttft_ms": 300, "request_goodput": None, "completed": 3}
    assert objective_value(summary, ObjectiveConfig()) == 12.5
    assert objective_value(summary, ObjectiveConfig("p99_ttft_ms", "minimize")) == 300.0
    with pytest.raises(ValueError, match="slo.ttft_ms"):
        objective_value(summary, ObjectiveConfig("request_goodput"))
    with pytest.raises(ValueError, match="numeric ones: completed, output_throughput, p99_ttft_ms"):
        objective_value(summary, ObjectiveConfig("throughput"))
    with pytest.raises(ValueError, match="objective.direction must be one of"):
        ObjectiveConfig(direction="up")
    check_sweeper_direction(ObjectiveConfig(direction="minimize"), {"direction": "minimize"})
    check_sweeper_direction(ObjectiveConfig(), {})  # the basic sweeper does not optimize
    with pytest.raises(ValueError, match="hydra.sweeper.direction=maximize"):
        check_sweeper_direction(ObjectiveConfig(), {"direction": "minimize"})


# -- the launchers, end to end -----------------------------------------------------------------------------------

def _sweep_dir(tmp_path: Path) -> Path:
    (summary,) = tmp_path.glob("multirun/*/*/summary.csv")
    return summary.parent


def _summary(tmp_path: Path) -> list[dict[str, str]]:
    with (_sweep_dir(tmp_path) / "summary.csv").open() as f:
        return list(csv.DictReader(f))


def _comparable(rows: list[dict[str, str]]) -> list[tuple]:
    """What must not depend on the launcher: jobs, swept settings, errors and request counts (not timings)."""
    return [(r["job"], r["engine.max_num_batched_tokens"], r["error"], r["completed"], r["failed"],
             r["total_output_tokens"] if "total_output_tokens" in r else "") for r in rows]


def _run_sweep(tmp_path: Path, *launcher: str, timeout: int = 300) -> list[dict[str, str]]:
    proc = run_cli(tmp_path, "-m", *launcher, *SWEEP, timeout=timeout)
    # The bad combination fails its job only: the sweep completes and then exits non-zero naming it.
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: 1 of 2 jobs failed (job 0)" in proc.stderr
    rows = _summary(tmp_path)
    assert [r["job"] for r in rows] == ["0", "1"]
    assert BAD_COMBINATION in rows[0]["error"] and rows[0]["completed"] == ""
    assert rows[1]["error"] == "" and rows[1]["completed"] == "3" and rows[1]["failed"] == "0"
    assert (_sweep_dir(tmp_path) / "summary.md").is_file()
    return rows


@pytest.fixture(scope="module")
def basic_summary(tmp_path_factory) -> list[dict[str, str]]:
    return _run_sweep(tmp_path_factory.mktemp("basic"))


def _job_log(tmp_path: Path, job: str) -> str:
    return (_sweep_dir(tmp_path) / job / "run.log").read_text()


def test_joblib_runs_jobs_in_parallel_with_a_fair_share_of_threads(tmp_path, basic_summary) -> None:
    rows = _run_sweep(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    assert _comparable(rows) == _comparable(basic_summary)
    assert rows[0].keys() == basic_summary[0].keys()
    expected = max(1, (os.cpu_count() or 1) // 2)
    proc_logs = [_job_log(tmp_path, job) for job in ("0", "1")]
    assert all(f"torch threads for this job: {expected} (fair share under" in log for log in proc_logs), proc_logs


def test_submitit_local_runs_the_sweep(tmp_path, basic_summary) -> None:
    rows = _run_sweep(tmp_path, "hydra/launcher=local")
    assert _comparable(rows) == _comparable(basic_summary)
    assert "torch threads for this job: 1 (fair share under" in _job_log(tmp_path, "1")
    # Each job ran in its own submitit process, whose result submitit pickled beside the sweep.
    assert len(list(_sweep_dir(tmp_path).glob(".submitit/*/*_result.pkl"))) == 2


def test_ray_launcher_on_a_local_instance(tmp_path, basic_summary) -> None:
    assert ray_processes() == [], "a Ray instance of this test process's is already running"
    rows = _run_sweep(tmp_path, "hydra/launcher=ray_cluster", "hydra.launcher.ray.init.address=null",
                      "+hydra.launcher.ray.init.num_cpus=2", "hydra.launcher.ray.remote.num_cpus=1")
    assert _comparable(rows) == _comparable(basic_summary)
    assert ray_processes() == []  # the launcher's local instance is shut down with the sweep


def test_optuna_tunes_toward_the_objective_and_survives_failed_trials(tmp_path) -> None:
    # Optuna's seeded TPE sampler, not its GridSampler: optuna 2.10's GridSampler calls study.stop() once the
    # grid is exhausted, which hydra-optuna-sweeper's ask/tell loop (outside optimize()) turns into a crash.
    proc = run_cli(tmp_path, "-m", "hydra/sweeper=tune", "hydra.sweeper.n_trials=6", "hydra.sweeper.sampler.seed=0",
                   *SIMULATED, "engine.enable_chunked_prefill=false",
                   "engine.max_num_batched_tokens=choice(16,512)", "engine.max_num_seqs=choice(1,3)",
                   "objective.metric=completed", timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # the 16-token budget is a bad combination
    results = OmegaConf.load(_sweep_dir(tmp_path) / "optimization_results.yaml")
    assert results.best_params["engine.max_num_batched_tokens"] == 512 and results.best_value == 3
    rows = _summary(tmp_path)
    assert len(rows) == 6
    bad = [r for r in rows if r["engine.max_num_batched_tokens"] == "16"]
    assert bad and all(r["error"] and BAD_COMBINATION in r["error"] for r in bad)
    assert all(not r["error"] for r in rows if r["engine.max_num_batched_tokens"] == "512")


def test_sweeper_direction_must_match_the_objective(tmp_path) -> None:
    # Optuna's own config minimizes; the default objective (output throughput) is to be maximized.
    proc = run_cli(tmp_path, "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=1", *TINY,
                   "engine.max_num_seqs=choice(2)", timeout=200)
    assert proc.returncode == 1
    assert "objective.direction=maximize but hydra.sweeper.direction=minimize" in proc.stderr
