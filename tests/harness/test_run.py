"""``python -m nanovllm.run`` end to end, in subprocesses with tiny settings: the run's files, a multirun's summary
table and shared W&B group, a user plugin, one-line errors for bad input, and a run from an installed wheel.
Config composition itself is checked in-process with Hydra's compose API (fast, no model)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from helpers import REPO, TINY, cli_env, one_error_line, run_cli
from nanovllm.allocator import ALLOCATORS
from nanovllm.attention.base import ATTENTION_BACKENDS
from nanovllm.config import EngineConfig
from nanovllm.policy import POLICIES
from nanovllm.harness.run import config_dir

POLICY_EXAMPLE = REPO / "experiments" / "my_policy.py"

# A synthetic workload of a few short prompts: every model-loading test stays a few seconds of compute.


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


# -- composition (in-process, no model) -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose_cfg():
    from nanovllm.harness.conf_schema import register_configs

    register_configs()

    def _compose(*overrides: str):
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))

    return _compose


def test_config_dir_in_a_checkout_is_the_top_level_conf() -> None:
    assert config_dir() == REPO / "conf"


def test_default_config(compose_cfg) -> None:
    cfg = compose_cfg()
    assert cfg.scheduler.name == "fcfs" and cfg.allocator.name == "paged" and cfg.attention.name == "auto"
    assert cfg.logger.name == "jsonl" and cfg.model.path is None and cfg.plugins == [] and cfg.progress
    assert cfg.workload.name == "chat" and list(cfg.workload.priority_classes) == [0, 1]
    assert cfg.workload.num_requests == 16
    # The engine node has exactly EngineConfig's names (model, speculative and kv_offload come from their groups)
    # and its defaults.
    assert set(cfg.engine) == {f for f in EngineConfig.__dataclass_fields__} - {"model", "speculative", "kv_offload"}
    defaults = EngineConfig()
    assert all(cfg.engine[k] == getattr(defaults, k) for k in cfg.engine
               if k not in ("max_num_seqs", "dtype", "num_kv_blocks"))
    assert cfg.engine.max_num_seqs == 4  # small on purpose: the default run queues, so policies differ
    assert cfg.engine.dtype == "bfloat16"  # runs take the fast path; LLM() stays on the float32 reference
    # The default run is worth watching: online arrivals and a cache small enough to page and preempt.
    assert cfg.engine.num_kv_blocks == 32 and cfg.workload.request_rate == 2.0
    # One seed drives the engine and the workload unless they are set apart.
    cfg = compose_cfg("seed=7")
    assert cfg.engine.seed == 7 and cfg.workload.seed == 7


def test_groups_and_options(compose_cfg) -> None:
    cfg = compose_cfg("scheduler=priority", "allocator=prefix", "workload=synthetic", "logger=wandb")
    assert OmegaConf.to_container(cfg.scheduler) == {"name": "priority", "preempt_for_priority": True}
    assert cfg.allocator.name == "prefix" and cfg.workload.name == "synthetic" and cfg.logger.mode == "offline"
    cfg = compose_cfg("scheduler=priority", "scheduler.preempt_for_priority=false", "+scheduler.extra=1")
    assert cfg.scheduler.preempt_for_priority is False and cfg.scheduler.extra == 1


@pytest.mark.parametrize("override", [
    "engine.num_kv_blokcs=8",           # misspelt engine key
    "engine.num_kv_blocks=many",        # wrong type
    "workload.num_request=3",           # misspelt workload key (schema of the chat workload)
    "workload.max_tokens=lots",
    "bogus=1",                          # unknown top-level key
    "scheduler.typo=1",                 # a policy option the group file does not have needs +
    "scheduler=nope",                   # unknown group option
    "slo.ttft_ms=fast",
])
def test_schema_rejects_mistakes(compose_cfg, override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        compose_cfg(override)


def test_every_builtin_plugin_has_a_config_file() -> None:
    for group, registry in (("scheduler", POLICIES), ("allocator", ALLOCATORS), ("attention", ATTENTION_BACKENDS)):
        files = {p.stem: p for p in (REPO / "conf" / group).glob("*.yaml")}
        # Built-ins only: a user plugin another test registered in this process has no config file, rightly.
        builtins = {name for name in registry.names()
                    if registry.get(name).__module__.split(".")[0] in {"nanovllm", "policies", "allocators"}}
        assert builtins <= set(files), f"conf/{group}/ lacks a file for a built-in name"
        for stem, path in files.items():
            assert OmegaConf.load(path).name == stem


# -- one run ------------------------------------------------------------------------------------------------------

def test_single_run_writes_its_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(tmp_path, "scheduler=priority", "allocator=paged", "workload.num_requests=4",
                   "workload.max_tokens=4", "engine.num_kv_blocks=128", "engine.max_model_len=512",
                   "monitor.calibrate=false", f"hydra.run.dir={run_dir}")
    _ok(proc)
    assert "Serving Benchmark Result" in proc.stdout and "Successful requests:" in proc.stdout
    assert re.search(r"^\s*priority\s+requests\s+done", proc.stdout, re.M)  # the per-class table

    assert (run_dir / ".hydra" / "config.yaml").is_file()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["completed"] + metrics["failed"] == 4 and metrics["completed"] >= 1
    assert set(metrics["breakdowns"]) == {"priority", "client_id"}
    assert set(metrics["breakdowns"]["priority"]) <= {"0", "1"}
    assert "mfu" in metrics and "mean_ttft_ms" in metrics
    # The engine warmed up before the run's clock started, and says so (log line and metrics.json).
    assert metrics["warmup_steps"] > 0 and metrics["warmup_time_s"] > 0
    assert "warm-up:" in proc.stdout + proc.stderr

    requests = _read_jsonl(run_dir / "requests.jsonl")
    assert sorted(r["request_id"] for r in requests) == ["0", "1", "2", "3"]
    for r in requests:
        assert r["finish_reason"] in ("stop", "length") or r["error"]
        if r["error"] is None:
            assert 1 <= r["num_output_tokens"] <= 4 and r["first_scheduled_time"] >= r["arrival_time"]
    steps = _read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(len(steps))) and len(steps) == metrics["num_steps"]
    assert all("flops" in s and "mfu" in s for s in steps)  # annotated by the monitor
    config = json.loads((run_dir / "config.json").read_text())
    assert config["scheduler"] == {"name": "priority", "preempt_for_priority": True}


# -- multirun -----------------------------------------------------------------------------------------------------

def _wandb_run_record(run_file: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    return run


def test_a_simulated_run_on_a_fresh_cache_builds_no_kernels(tmp_path: Path, llm) -> None:
    """A simulated run attends nothing, so on a machine whose kernel cache is empty it compiles none (the CPU
    attention backend's build took minutes before anything was simulated). The cache here holds only the
    converted model, linked from the session's (``llm`` made it)."""
    from nanovllm.paths import CACHE_ENV, cache_root

    cache = tmp_path / "cache"
    cache.mkdir()
    for entry in cache_root().iterdir():
        if entry.name not in ("extensions", "sim-profiles"):
            (cache / entry.name).symlink_to(entry)
    proc = run_cli(tmp_path, *TINY, "runner=sim", "runner.step_time=token_cost", "attention=cpu",
                   f"hydra.run.dir={tmp_path / 'run'}", env=cli_env(tmp_path, **{CACHE_ENV: str(cache)}))
    _ok(proc)
    summary = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert summary["completed"] == 3
    assert not (cache / "extensions").exists() or not any((cache / "extensions").iterdir())


def test_multirun_summary_table_and_shared_wandb_group(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(tmp_path, "-m", "scheduler=fcfs,priority", "logger=wandb", *TINY,
                   f"hydra.sweep.dir={sweep_dir}", timeout=360)
    _ok(proc)
    assert "requests:" not in proc.stderr  # the progress bar is quiet in multirun

    import csv

    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [(r["job"], r["scheduler"]) for r in rows] == [("0", "fcfs"), ("1", "priority")]
    assert all(r["completed"] == "3" and r["error"] == "" for r in rows)
    assert float(rows[0]["output_throughput"]) > 0
    md = (sweep_dir / "summary.md").read_text().splitlines()
    assert md[0].startswith("| job | scheduler |") and len(md) == 4
    assert md[2].startswith("| 0 | fcfs |") and md[3].startswith("| 1 | priority |")
    assert "| job | scheduler |" in proc.stdout  # printed at the end of the sweep too

    groups = set()
    for job in ("0", "1"):
        job_dir = sweep_dir / job
        assert (job_dir / "metrics.json").is_file() and (job_dir / "requests.jsonl").is_file()
        (offline,) = (job_dir / "wandb").glob("offline-run-*")
        run = _wandb_run_record(next(offline.glob("run-*.wandb")))
        groups.add(run["run_group"])
        assert "scheduler=" in run["display_name"]
    assert groups == {sweep_dir.name}


def test_multirun_with_failing_jobs_runs_them_all_and_exits_non_zero(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(tmp_path, "-m", "scheduler.name=nope,priorty", f"hydra.sweep.dir={sweep_dir}", timeout=120)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 3 and "2 of 2 jobs failed" in errors[-1] and "Traceback" not in proc.stderr
    md = (sweep_dir / "summary.md").read_text()
    assert "unknown policy 'nope'" in md and "Did you mean 'priority'?" in md


def test_sweep_summary_of_a_failed_job(tmp_path: Path) -> None:
    from nanovllm.harness.sweep import summarize_sweep

    for job, overrides, outcome in (("0", ["scheduler=fcfs", "seed=1"], {"completed": 3, "mean_ttft_ms": 1.5}),
                                    ("1", ["scheduler=nope", "seed=1"], None)):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
        if outcome is None:
            (tmp_path / job / "error.txt").write_text("unknown policy 'nope'\n")
        else:
            (tmp_path / job / "metrics.json").write_text(json.dumps({**outcome, "breakdowns": {"priority": {}}}))
    rows = summarize_sweep(tmp_path)
    assert [(r["job"], r["scheduler"], r["error"]) for r in rows] == [
        ("0", "fcfs", None), ("1", "nope", "unknown policy 'nope'")]
    assert "seed" not in rows[0]  # only the settings that differ get a column
    md = (tmp_path / "summary.md").read_text()
    assert md.splitlines()[0] == "| job | scheduler | completed | mean_ttft_ms | error |"
    assert "breakdowns" not in (tmp_path / "summary.csv").read_text()


# -- user plugin ----------------------------------------------------------------------------------------------------

def test_user_policy_example_runs_from_plugins(tmp_path: Path) -> None:
    """experiments/my_policy.py, named as in the README, runs the way the README says."""
    run_dir = tmp_path / "run"
    # Distinct prompt lengths, all arriving at once, one at a time: the run order shows the policy's order.
    overrides = [o for o in TINY if not o.startswith("workload.input_len")] + [
        "workload.input_len.kind=uniform", "workload.input_len.mean=20", "workload.input_len.range_ratio=0.9",
        "workload.num_requests=4", "engine.max_num_seqs=1", "progress=false",
    ]
    proc = run_cli(tmp_path, "plugins=[experiments/my_policy.py]", "scheduler.name=shortest_prompt_first",
                   "+scheduler.max_wait=60", *overrides, f"hydra.run.dir={run_dir}", cwd=REPO)
    _ok(proc)
    requests = _read_jsonl(run_dir / "requests.jsonl")
    assert len(requests) == 4 and all(r["error"] is None for r in requests)
    in_run_order = sorted(requests, key=lambda r: r["first_scheduled_time"])
    lengths = [r["num_prompt_tokens"] for r in in_run_order]
    assert lengths == sorted(lengths) and len(set(lengths)) > 1
    assert json.loads((run_dir / "config.json").read_text())["scheduler"] == {
        "name": "shortest_prompt_first", "max_wait": 60}


def test_readme_policy_snippet_is_the_example_file() -> None:
    readme = REPO / "README.md"
    assert "experiments/my_policy.py" in readme.read_text()
    code = POLICY_EXAMPLE.read_text()
    snippet = code[code.index("from nanovllm import"):].strip()
    assert snippet in readme.read_text(), "README's policy snippet differs from experiments/my_policy.py"


# -- bad input: one error line, non-zero exit -----------------------------------------------------------------------

BOOM_PLUGIN = '''
from nanovllm import Policy, register_policy

@register_policy("boom")
class Boom(Policy):
    def priority(self, request, now):
        return 1 / 0
'''


# Through the CLI: the one-line contract, for each kind of mistake. Each case costs a process start (torch
# import), so the variants of each kind are checked in-process below.
@pytest.mark.parametrize("overrides, expected", [
    (["scheduler.name=priorty"], ["unknown policy 'priorty'", "fcfs", "priority", "Did you mean 'priority'"]),
    (["plugins=[broken_plugin]"], ["broken_plugin", "failed to import", "RuntimeError", "broken on purpose"]),
    (["workload.num_requests=0"], ["workload.num_requests=0", "integer >= 1"]),
    (["engine.block_size=0"], ["engine.block_size", ">= 1"]),
    (["allocator=radix", "allocator.eviction=mru"], ["allocator.eviction must be one of fifo, lfu, lru", "'mru'"]),
    (["scheduler=sjf", "scheduler.predictor=psychic"],
     ["scheduler.predictor must be one of oracle, prompt_length, client_history", "'psychic'"]),
    # Found by Hydra while composing, folded into one line by nanovllm/harness/errors.py
    (["engine.num_kv_blocks=many"], ["engine.num_kv_blocks=many", "could not be converted to Integer"]),
    (["slo.ttft=100"], ["slo.ttft", "not in 'SLO'"]),
])
def test_bad_input_fails_before_the_model_loads_with_one_line(tmp_path: Path, overrides, expected) -> None:
    # A module name (not a path) is looked up in the working directory, also from the console script.
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('broken on purpose')\n")
    proc = run_cli(tmp_path, *overrides, "progress=false", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    line = one_error_line(proc)
    for text in expected:
        assert text in line


def test_pre_model_checks_name_what_is_wrong(tmp_path: Path, compose_cfg, monkeypatch) -> None:
    from nanovllm import LLM, PluginImportError, load_plugins
    from nanovllm.harness.run import _check_missing, _engine_field_errors, plugin_spec

    with pytest.raises(ValueError, match=r"unknown allocator 'nope'.*contiguous, paged, prefix"):
        plugin_spec(ALLOCATORS, {"name": "nope"}, "allocator")
    with pytest.raises(ValueError, match=r"scheduler='priority' does not take options \['nonsense'\]"):
        plugin_spec(POLICIES, {"name": "priority", "nonsense": 1}, "scheduler")
    assert plugin_spec(POLICIES, {"name": "priority", "preempt_for_priority": False}, "scheduler")["name"]
    with pytest.raises(ValueError, match="scheduler.name is not set"):
        plugin_spec(POLICIES, {}, "scheduler")

    monkeypatch.chdir(tmp_path)
    with pytest.raises(PluginImportError, match="'no_such_plugin_module' failed to import.*No module named"):
        load_plugins(["no_such_plugin_module"])
    with pytest.raises(PluginImportError, match="'missing.py' does not exist"):
        load_plugins(["missing.py"])
    (tmp_path / "syntax_error.py").write_text("def (:\n")
    with pytest.raises(PluginImportError, match="syntax_error.py.*SyntaxError"):
        load_plugins(["syntax_error.py"])
    with pytest.raises(PluginImportError, match="'missing.py' does not exist"):
        LLM(plugins=["missing.py"])   # the Python front door loads the same files, before anything else

    with pytest.raises(ValueError, match=r"no value for model.path"):
        _check_missing(compose_cfg("model=hf"))
    with pytest.raises(ValueError, match=r"^engine.dtype must be one of"):
        with _engine_field_errors():
            EngineConfig(dtype="float64")


def test_policy_that_raises_is_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "boom.py").write_text(BOOM_PLUGIN)
    proc = run_cli(tmp_path, "plugins=[boom.py]", "scheduler.name=boom", *TINY, "progress=false",
                   f"hydra.run.dir={tmp_path / 'run'}")
    line = one_error_line(proc)
    assert "policy 'boom' raised in priority()" in line and "ZeroDivisionError" in line


@pytest.mark.parametrize("overrides, expected", [
    (["runner=sim", "runner.step_time=analytical", "hardware=nope"],
     ["hardware=nope: no such hardware config", "available: a100_sxm, h100_sxm", "conf/hardware"]),
    (["runner=nope"], ["runner=nope: no such runner config", "available: http, real, sim"]),
    (["-m", "scheduler=fcfs,priorty"], ["scheduler=priorty", "fcfs", "Did you mean 'priority'"]),
    (["hardware=null"], ["hardware=null", "~hardware"]),
])
def test_unknown_group_option_is_one_error_line(tmp_path: Path, overrides, expected) -> None:
    proc = run_cli(tmp_path, *overrides, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                   timeout=120)
    line = one_error_line(proc)
    assert proc.returncode == 1  # as every other bad input of nanovllm.run
    for text in expected:
        assert text in line
    assert not (tmp_path / "sweep").exists()  # found before any job started


def test_group_choice_check_passes_what_hydra_accepts() -> None:
    from nanovllm.harness.errors import check_group_choices

    conf = config_dir()
    # Existing options, sweeps of them, Hydra's own groups, non-group keys (even =null) and deletions pass.
    check_group_choices(["-m", "runner=sim", "hardware=h100_sxm", "scheduler=fcfs,priority", "+allocator=prefix",
                         "hydra/launcher=joblib", "seed=null", "engine.dtype=float32", "~hardware",
                         "scheduler=glob(*)"], conf)
    # A changed search path may hold other options: left to Hydra.
    check_group_choices(["hardware=mine", "hydra.searchpath=[file:///elsewhere]"], conf)
    check_group_choices(["--config-dir", "/elsewhere", "hardware=mine"], conf)
    with pytest.raises(ValueError, match=r"^allocator=pagd: no such allocator config; available: .*paged.*"
                                         r"Did you mean 'paged'\?"):
        check_group_choices(["allocator=pagd"], conf)
    with pytest.raises(ValueError, match=r"^workload=\[chat,nope\]|^workload=nope"):
        check_group_choices(["workload=[chat,nope]"], conf)


def test_trace_file_of_the_wrong_schema_is_one_line_naming_file_and_field(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_time": 0, "prompt": "hi"}\n{"arrival_time": 1, "promt": "typo"}\n')
    # The workload is read once the engine is built; the simulated one loads no weights, and torch attention
    # needs no kernel build.
    proc = run_cli(tmp_path, "workload=trace", f"workload.path={trace}", "runner=sim", "attention=torch",
                   "progress=false",
                   f"hydra.run.dir={tmp_path / 'run'}", timeout=180)
    line = one_error_line(proc)
    assert f"{trace}:2:" in line and "'promt'" in line


def test_full_traceback_with_hydra_full_error(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "scheduler.name=nope", f"hydra.run.dir={tmp_path / 'run'}", timeout=120,
                   env=cli_env(tmp_path, HYDRA_FULL_ERROR="1"))
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "UnknownPluginError" in proc.stderr


# -- from an installed wheel ----------------------------------------------------------------------------------------

def test_runs_from_an_installed_wheel(tmp_path: Path) -> None:
    wheel_dir, src = tmp_path / "wheel", tmp_path / "src"
    # Build from a copy: pip builds in the source tree (build/, *.egg-info), which must not touch the checkout.
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("nanovllm", "conf", "policies", "allocators", "routers"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        if (REPO / name).is_file():
            shutil.copy(REPO / name, src / name)
    # A config group added later ships too: packaging finds the groups, it does not list them.
    (src / "conf" / "probe_group").mkdir()
    (src / "conf" / "probe_group" / "option.yaml").write_text("name: probe\n")
    groups = sorted(p.name for p in (src / "conf").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert {"model", "scheduler", "allocator", "attention", "workload", "logger", "probe_group"} <= set(groups)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheel_dir), str(src)], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheel_dir.glob("nanovllm-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    for path in (src / "conf").rglob("*.yaml"):
        name = f"nanovllm/conf/{path.relative_to(src / 'conf').as_posix()}"
        assert name in shipped, f"{name} is missing from the wheel"
    # A fresh venv holding only the wheel; its dependencies (torch, transformers, ...) come from the
    # project's environment through a .pth file, so nothing is downloaded. The .pth adds a plain path:
    # the project's own editable install of nanovllm is not visible from it.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "project_deps.pth").write_text("\n".join(deps) + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q",
                              str(wheel)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-3000:]

    env = {k: v for k, v in cli_env(tmp_path).items() if k != "PYTHONPATH"}
    where = subprocess.run([python, "-c", "import nanovllm.harness.run as r; print(r.__file__); print(r.config_dir())"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    module_file, conf = where.stdout.split()
    assert Path(module_file).is_relative_to(site) and Path(conf) == site / "nanovllm" / "conf"
    installed = sorted(p.name for p in Path(conf).iterdir() if p.is_dir() and p.name != "__pycache__")
    assert installed == groups

    run_dir = tmp_path / "run"
    proc = run_cli(tmp_path, *TINY, "progress=false", f"hydra.run.dir={run_dir}", env=env, python=python)
    _ok(proc)
    assert json.loads((run_dir / "metrics.json").read_text())["completed"] == 3
    hydra_yaml = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml")
    main_source = [s for s in hydra_yaml.hydra.runtime.config_sources if s.schema == "file"][0]
    assert Path(main_source.path) == site / "nanovllm" / "conf"
