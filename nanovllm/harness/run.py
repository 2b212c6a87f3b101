"""``python -m nanovllm.run``: compose a config with Hydra, build the engine, serve a workload in real time,
print the serving summary and write the run's files (``metrics.json``, ``requests.jsonl``, ``steps.jsonl``)
into Hydra's run directory beside ``.hydra/``::

    python -m nanovllm.run scheduler=priority allocator=prefix
    python -m nanovllm.run workload=synthetic workload.request_rate=4 engine.num_kv_blocks=256
    python -m nanovllm.run -m scheduler=fcfs,priority          # one job each + summary.csv/.md of the sweep
    python -m nanovllm.run plugins=[experiments/my_policy.py] scheduler.name=shortest_prompt_first

Configs live in ``conf/`` (shipped as ``nanovllm.conf``); their schema is ``nanovllm/harness/conf_schema.py``.
Everything a user can get wrong (an unknown config-group option, an override Hydra cannot compose, an unknown
plugin name, a plugin that does not import, an impossible workload or engine value, a policy that raises) ends
the run with one ``error: ...`` line on stderr and exit status 1 -- the traceback only with
``HYDRA_FULL_ERROR=1``; how each is caught is ``nanovllm.harness.errors``.
Everything that can be checked before the model loads is, the attention backend's availability on the device
included (``attention=flashinfer`` on a CPU machine fails before the model or the kernels load).

Ctrl-C (SIGINT) or SIGTERM before serving starts -- while importing, composing, checking, loading the model,
building the kernels or waiting for another process's build, warming up -- ends the run at once with one
``error: interrupted by SIGINT while <phase>; nothing was served`` line and status 130 (143 for SIGTERM); once
serving, the run stops after the current step and writes its files (``nanovllm.harness.interrupt``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Iterator

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from nanovllm.allocator import ALLOCATORS
from nanovllm.attention.base import ATTENTION_BACKENDS, check_attention_available, resolve_attention
from nanovllm.cluster.config import ClusterConfig
from nanovllm.cluster.kv_transfer import KV_TRANSFERS
from nanovllm.config import EngineConfig, torch_dtype
from nanovllm.engine.runner import RUNNERS
from nanovllm.harness.conf_schema import register_configs
from nanovllm.harness.errors import (
    check_group_choices,
    exit_with_error,
    full_tracebacks,
    one_line_errors,
    print_error,
    user_errors,
)
from nanovllm.harness.interrupt import STOP, StartupInterrupt, interrupt_message, one_line_interrupts
from nanovllm.harness.live.config import LiveConfig
from nanovllm.harness.objective import (
    ObjectiveConfig,
    check_sweeper_direction,
    objective_value,
)
from nanovllm.harness.option_types import plugin_spec
from nanovllm.harness.parallel_jobs import apply_fair_share
from nanovllm.harness.sim.speculation import build_acceptance
from nanovllm.harness.workload import validate_workload_config
from nanovllm.plugins import load_plugins
from nanovllm.policy import POLICIES
from nanovllm.engine.kv_offload import check_kv_offload
from nanovllm.proposer import PROPOSERS, check_speculative
from nanovllm.router import ROUTERS
from nanovllm.sampling import SamplingParams
from nanovllm.serving.loggers import LOGGERS, JsonlLogger, RunLogger
from nanovllm.serving.metrics import SLO, format_summary
from nanovllm.serving.monitor import MonitorConfig
from nanovllm.serving.step_records import StepRecords
from nanovllm.spec_policy import check_spec_policy


# -- where the configs are -----------------------------------------------------------------------------------------

def config_dir() -> Path:
    """``conf/``: at the top of the source checkout this code runs from, else inside the installed package
    (``nanovllm.conf``). The checkout first: an editable install maps ``nanovllm.conf`` to the checkout it was
    installed from, which is another tree when the code runs from a second worktree of the repository."""
    checkout = Path(__file__).resolve().parent.parent.parent / "conf"
    if (checkout / "config.yaml").is_file():
        return checkout
    spec = importlib.util.find_spec("nanovllm.conf")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).resolve()
    raise FileNotFoundError(f"cannot find nanovllm's configs: no package nanovllm.conf and no {checkout}")


# -- checks that run before the model loads ------------------------------------------------------------------------

def _check_model_path(path: str | None) -> None:
    """A set ``model.path`` must exist (null: the default model); what is inside is the loader's to check."""
    if path is not None and not Path(path).expanduser().exists():
        raise ValueError(f"model.path={path!r}: no such file or directory (cwd: {os.getcwd()}); expected a local "
                         "HF directory with config.json or a .gguf file")


def _check_device(device: str) -> None:
    """``engine.device=cuda`` needs CUDA (``LLMEngine`` says so too, but only after importing the engine)."""
    import torch

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"engine.device={device!r} was asked for but CUDA is not available; use engine.device=cpu")


def _check_missing(cfg: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(f"no value for {', '.join(missing)}; set it on the command line, e.g. {missing[0]}=...")


@contextlib.contextmanager
def _engine_field_errors() -> Iterator[None]:
    """EngineConfig's messages start with the field's name; say it as the override is spelt (engine.X)."""
    try:
        yield
    except ValueError as exc:
        field_names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        if str(exc).split(" ", 1)[0] in field_names:
            raise ValueError(f"engine.{exc}") from exc
        raise


# -- the run -------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Checked:
    """The config turned into checked, plain arguments: everything that can be wrong is found before the
    model loads."""

    engine: EngineConfig
    scheduler: dict[str, Any]
    allocator: dict[str, Any]
    attention: dict[str, Any]
    logger: dict[str, Any]
    slo: SLO
    monitor: MonitorConfig
    live: LiveConfig = dataclasses.field(default_factory=LiveConfig)
    runner: dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "real"})
    hardware: dict[str, Any] | None = None
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    router: dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "round_robin"})
    step_records: StepRecords = dataclasses.field(default_factory=StepRecords)


# The free-form nodes of the schema (typed Any, so Hydra lets any value through): each must be a mapping.
_MAPPING_NODES = ("scheduler", "allocator", "attention", "logger", "workload", "runner", "router")


def _check_mappings(cfg: DictConfig) -> None:
    for key in (*_MAPPING_NODES, "hardware"):
        node = cfg.get(key)
        if not isinstance(node, DictConfig) and not (key == "hardware" and node is None):
            allowed = "a mapping or null" if key == "hardware" else "a mapping"
            raise ValueError(f"{key} must be {allowed} (pick a file with {key}=<option>, or set {key}.name=...), "
                             f"got {node!r}")


def _speculative(cfg: DictConfig) -> dict[str, Any] | None:
    """The ``speculative`` group as ``EngineConfig.speculative`` (method null: off); its proposer and options are
    checked here, before the model loads."""
    node = cfg.get("speculative")
    if node is None:
        return None
    if not isinstance(node, DictConfig):
        raise ValueError(f"speculative must be a mapping (pick a file with speculative=<option>), got {node!r}")
    spec = OmegaConf.to_container(node, resolve=True)
    method = spec.get("method")
    if method is not None and (not isinstance(method, str) or method not in PROPOSERS):
        raise ValueError(f"speculative.method must be null (off) or a registered proposer "
                         f"({', '.join(PROPOSERS.names())}), got {method!r}")
    config = EngineConfig(speculative=spec)
    check_speculative(config)
    check_spec_policy(config.speculative)
    return spec


def _kv_offload(cfg: DictConfig) -> Any:
    """The ``kv_offload`` group as ``EngineConfig.kv_offload`` (name none: off), checked before the model loads."""
    node = cfg.get("kv_offload")
    spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    return spec if check_kv_offload(spec) is not None else None


def check_config(cfg: DictConfig) -> _Checked:
    _check_missing(cfg)
    _check_mappings(cfg)
    load_plugins(cfg.plugins)  # first: a plugin may register the names checked below
    validate_workload_config(cfg.workload)
    _check_model_path(cfg.model.path)
    with _engine_field_errors():
        engine = EngineConfig.from_options(model=cfg.model.path, speculative=_speculative(cfg),
                                           kv_offload=_kv_offload(cfg), **cfg.engine)
    SamplingParams(temperature=cfg.temperature)  # validates it
    runner = OmegaConf.to_container(cfg.runner, resolve=True)
    hardware = OmegaConf.to_container(cfg.hardware, resolve=True) if cfg.get("hardware") is not None else None
    from nanovllm.harness.runners import check_runner  # the engine (transformers): after the cheap checks

    check_runner(runner, hardware)
    cluster = _check_cluster(cfg, engine, runner)
    attention = plugin_spec(ATTENTION_BACKENDS, resolve_attention(dict(cfg.attention), engine.device), "attention")
    if engine.speculative is not None and not RUNNERS.get(runner["name"]).supports_speculation:
        raise ValueError(f"speculative={engine.speculative['method']} needs a runner that verifies proposals; "
                         f"runner={runner['name']} does not (use runner=real)")
    if engine.speculative is not None and runner["name"] == "sim":   # the acceptance model, before anything loads
        build_acceptance(runner.get("acceptance"), runner.get("acceptance_run"), runner.get("acceptance_seed", 0),
                         str(engine.speculative["method"]), int(engine.speculative["num_speculative_tokens"]))
    if RUNNERS.get(runner["name"]).loads_model:  # a simulated run runs no model and no attention: any device
        _check_device(engine.device)
        check_attention_available(attention, engine.device)
    return _Checked(
        engine=engine,
        scheduler=plugin_spec(POLICIES, cfg.scheduler, "scheduler"),
        allocator=plugin_spec(ALLOCATORS, cfg.allocator, "allocator"),
        attention=attention,
        logger=plugin_spec(LOGGERS, cfg.logger, "logger"),
        slo=SLO(**cfg.slo),
        monitor=MonitorConfig(**cfg.monitor),
        runner=runner,
        hardware=hardware,
        live=LiveConfig(**cfg.live),
        cluster=cluster,
        router=_check_router(cfg.router, cluster),
        step_records=StepRecords.parse(cfg.get("records", {}).get("steps")),
    )


def _check_router(node: DictConfig, cluster: ClusterConfig) -> dict[str, Any]:
    """The router node, checked; with disaggregation its ``prefill`` and ``decode`` pool routers too (each a
    name or a mapping; null: the node's own router)."""
    spec = {key: value for key, value in node.items() if key not in ("prefill", "decode")}
    checked = plugin_spec(ROUTERS, OmegaConf.create(spec), "router")
    for pool in ("prefill", "decode"):
        value = node.get(pool)
        if value is None:
            continue
        if not cluster.disaggregated:
            raise ValueError(f"router.{pool} routes a pool of prefill/decode disaggregation: set "
                             "cluster.prefill_replicas and cluster.decode_replicas, or drop it")
        pool_node = OmegaConf.create({"name": value} if isinstance(value, str) else
                                     OmegaConf.to_container(value, resolve=True))
        checked[pool] = plugin_spec(ROUTERS, pool_node, f"router.{pool}")
    return checked


def _check_cluster(cfg: DictConfig, engine: EngineConfig, runner: dict[str, Any]) -> ClusterConfig:
    """The ``cluster`` node: a replica count, overrides that make valid engine settings, and a runner that
    can serve replicas (each replica's settings are checked now, before anything loads)."""
    node = OmegaConf.to_container(cfg.cluster, resolve=True)
    if node.get("kv_transfer", "shared_memory") != "shared_memory":
        raise ValueError("cluster.kv_transfer is the Python API's spelling; on the command line pick "
                         "kv_transfer=NAME (conf/kv_transfer/) and set kv_transfer.<option>=...")
    node["kv_transfer"] = plugin_spec(KV_TRANSFERS, cfg.kv_transfer, "kv_transfer")
    cluster = ClusterConfig(**node)
    for index in cluster.replica_overrides:
        cluster.engine_config(engine, index)
    if cluster.replicas > 1 and runner["name"] not in ("sim", "real"):
        raise ValueError(f"cluster.replicas={cluster.replicas} needs runner=real (replicas in Ray actors) or "
                         f"runner=sim (simulated replicas on one virtual clock); runner={runner['name']} serves one "
                         "engine")
    if cluster.replicas > 1 and cfg.live.mode == "tui":
        raise ValueError(f"live=tui draws one engine in the terminal; with cluster.replicas={cluster.replicas} use "
                         "live=web (every replica's batch and KV usage) or live=off")
    if cluster.replicas > 1 and runner["name"] == "real" and importlib.util.find_spec("ray") is None:
        raise ValueError(f"cluster.replicas={cluster.replicas} runs its replicas on Ray, which is not installed "
                         "(pip install 'nanovllm[ray]'), or use runner=sim")
    return cluster


def run(cfg: DictConfig) -> dict[str, Any]:
    """Serve the configured workload once; return the summary. Writes into Hydra's run directory."""
    from nanovllm.harness.runners import HTTP, check_runner  # the engine (transformers): once a run starts

    if cfg.runner.get("name") == HTTP:  # an OpenAI-compatible server serves it: nanovllm/harness/http_client.py
        from nanovllm.harness.http_client import run_over_http  # httpx, for runner=http only

        check_runner(OmegaConf.to_container(cfg.runner, resolve=True), None)
        return run_over_http(cfg, HydraConfig.get())
    checked = check_config(cfg)
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN

    # The slow part: torch, transformers and the model.
    STOP.starting("importing the engine")
    from nanovllm.harness.live.launch import start_live
    from nanovllm.serving.monitor import Monitor
    from nanovllm.harness.runners import served_engine
    from nanovllm.harness.serving import format_breakdown
    from nanovllm.harness.workload import generate_workload

    plugins = dict(scheduler=checked.scheduler, allocator=checked.allocator, attention=checked.attention)
    live = start_live(checked.live, run_dir)  # live=web: the dashboard process starts while the model loads
    try:
        STOP.starting("starting the engine")  # the model, the kernels, the warm-up: see interrupt.startup_phase
        with _engine_field_errors():
            served = served_engine(checked.runner, checked.hardware, checked.engine, cluster=checked.cluster,
                                   router=checked.router, plugin_paths=list(cfg.plugins), **plugins)
        engine = served.engine
        STOP.starting("generating the workload")
        workload = generate_workload(cfg.workload, engine.tokenizer)
        STOP.starting("calibrating the monitor")
        monitor = Monitor.from_config(served.cost, served.monitor_config(checked.monitor),
                                      torch_dtype(engine.config.dtype), checked.engine.device)
    except BaseException:
        live.close()  # the dashboard process must not outlive a start-up that failed or was interrupted
        if "served" in locals():
            served.close()
        raise
    STOP.starting("starting the loggers")

    loggers: list[RunLogger] = [LOGGERS.build(checked.logger)]
    if not isinstance(loggers[0], JsonlLogger):
        loggers.append(JsonlLogger())  # the run's files are always written, whatever else logs it
    # Jobs of one sweep share a W&B group: the configured one, else the sweep directory's name.
    group = (checked.logger.get("group") or Path(str(hc.sweep.dir)).name) if multirun else None
    name = (hc.job.override_dirname or f"job{hc.job.num}") if multirun else run_dir.name
    config = OmegaConf.to_container(cfg, resolve=True)
    loggers += live.attach(engine, len(workload))
    started: list[RunLogger] = []
    try:
        for logger in loggers:
            logger.start(run_dir, config, group=group, name=name)
            started.append(logger)
        STOP.serving()  # from here a signal stops the run after the current step, its files written
        result = served.serve(workload, progress=cfg.progress and not multirun and checked.live.mode != "tui",
                              loggers=loggers, monitor=monitor, slo=checked.slo, temperature=cfg.temperature,
                              stop=STOP.event, step_records=checked.step_records)
    except BaseException:
        live.close()
        raise
    finally:
        for logger in started:
            logger.finish()
        served.close()  # real replicas (Ray actors) end with the run, whatever ended it

    print(format_summary(result.summary))
    print(format_breakdown(result.by_priority, "priority"))
    if len(result.by_client) > 1:
        print(format_breakdown(result.by_client, "client_id"))
    if "per_replica" in result.summary:
        from nanovllm.harness.cluster import format_per_replica  # the cluster modules, for cluster runs only

        print(format_per_replica(result.summary))
    print(f"run files: {run_dir}")
    live.close(keep_open=checked.live.keep_open and not multirun)
    return result.summary


def _task(cfg: DictConfig) -> float | None:
    """Hydra's task function: one run. Under a sweeper that optimizes (``hydra/sweeper=optuna``/``tune``) it
    returns the run's objective (``objective.metric``); None otherwise, and for a multirun job that failed
    (Optuna: a failed trial)."""
    hc = HydraConfig.get()
    if STOP.requested:  # a later job of an interrupted multirun: do not start it
        _stopped(f"not run: the sweep was interrupted by {STOP.name}")
        return None
    STOP.starting("checking the config")
    try:
        objective = _prepare_job(cfg, hc)
        summary = run(cfg)
        if STOP.requested:
            _stopped(f"interrupted by {STOP.name}; the run's files hold what finished")
            return None
        optimizing = hc.mode == RunMode.MULTIRUN and hc.sweeper.get("direction") is not None
        return objective_value(summary, objective) if optimizing else None
    except StartupInterrupt as exc:
        # A single run: one_line_interrupts (main) says where it was and exits 130 / 143. A job of a multirun
        # notes it like a job that was stopped while serving; the jobs after it do not start (STOP.requested),
        # and the sweep's summary, over the jobs that ran, exits with the signal's status.
        if hc.mode != RunMode.MULTIRUN or full_tracebacks():
            raise
        _stopped(interrupt_message(exc))
        return None
    except Exception as exc:
        if full_tracebacks():
            raise
        user_error = isinstance(exc, user_errors())
        if hc.mode == RunMode.MULTIRUN:
            # Let the other jobs run, whichever launcher runs them; the sweep summary lists this one with its
            # error and exits non-zero at the end.
            return _record_job_error(exc, Path(hc.runtime.output_dir), user_error)
        if not user_error:
            raise
        # From inside the job: raised, it would reach the user through Hydra's "Error executing job" line.
        exit_with_error(str(exc))
    finally:
        if hc.mode == RunMode.MULTIRUN:  # between jobs, a signal stops the sweep after this one (as before it)
            STOP.serving("running the sweep")


def _stopped(message: str) -> None:
    """After a stop request: a single run exits with the signal's status (130 / 143); a multirun job notes it
    in ``error.txt`` and the sweep summary, written over the jobs that ran, exits with that status."""
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        exit_with_error(message, STOP.exit_status)
    print_error(message)
    Path(hc.runtime.output_dir).mkdir(parents=True, exist_ok=True)
    Path(hc.runtime.output_dir, "error.txt").write_text(f"{message}\n", encoding="utf-8")


# -- beyond one process: launchers run jobs side by side, sweepers read the objective ------------------------------

def _prepare_job(cfg: DictConfig, hc: Any) -> ObjectiveConfig:
    """Check the objective against the sweeper, and give a job run beside others its fair share of threads."""
    objective = ObjectiveConfig(**cfg.objective)
    if hc.mode == RunMode.MULTIRUN:
        check_sweeper_direction(objective, hc.sweeper)
        if apply_fair_share(hc.launcher) is not None:
            import torch

            # Through logging, so it lands in the job's run.log under every launcher.
            logging.getLogger(__name__).info("torch threads for this job: %d (fair share under %s)",
                                             torch.get_num_threads(), hc.launcher._target_)
    return objective


def _record_job_error(exc: Exception, job_dir: Path, user_error: bool) -> None:
    message = str(exc) if user_error else f"{type(exc).__name__}: {exc}"
    print_error(message)
    if not user_error:
        traceback.print_exc()
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "error.txt").write_text(f"{message}\n", encoding="utf-8")


def main() -> None:
    """Entry point of ``python -m nanovllm.run`` and the ``nanovllm-run`` console script."""
    # Ctrl-C before serving starts ends the run at once with one line (nanovllm/run.py installs this before
    # the heavy imports; here again for a caller of this function).
    with STOP.installed(), one_line_interrupts():
        STOP.starting("composing the config")
        register_configs()
        with one_line_errors():
            # An unknown group option is caught before Hydra starts (with the options and a close match, and
            # before any job of a sweep runs); whatever Hydra finds while composing is one line too.
            check_group_choices(sys.argv[1:], config_dir())
            hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")(_task)()


if __name__ == "__main__":
    main()
