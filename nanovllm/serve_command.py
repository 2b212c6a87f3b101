"""The command behind ``python -m nanovllm.serve``, where the HTTP server (``nanovllm.server``, which stands on the
core and ``nanovllm.serving`` alone) meets the research harness's configuration: the same Hydra configuration as ``python -m nanovllm.run`` (model, scheduler,
allocator, attention, engine, logger, live, plugins, monitor, slo) plus ``server.*``, and instead of a workload
an OpenAI-compatible HTTP server on ``server.host:server.port``::

    python -m nanovllm.serve                                        # the default model on 127.0.0.1:8000
    python -m nanovllm.serve scheduler=priority allocator=prefix server.port=8001 server.api_key=secret
    python -m nanovllm.serve engine.max_num_seqs=64 engine.num_kv_blocks=2048 live=web

A server run is a run: its Hydra run directory gets ``requests.jsonl`` and ``steps.jsonl`` as requests end and
steps run, and ``metrics.json`` at shutdown (and on ``POST /run/summary``), so ``python -m nanovllm.viz``,
``live=web`` and ``logger=wandb`` work as for ``python -m nanovllm.run``. Everything that can be checked before
the model loads is (the config, the port being free). SIGINT / SIGTERM before serving end the process at once
(130 / 143, one line); while serving, the server stops accepting, ends every request in flight (aborted,
reason ``interrupted``, its stream closed with that finish reason), writes its files and exits 130 / 143.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, cast

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from nanovllm.config import torch_dtype
from nanovllm.harness.conf_schema import register_configs
from nanovllm.harness.errors import check_group_choices, exit_with_error, one_line_errors, user_errors
from nanovllm.harness.interrupt import STOP
from nanovllm.harness.live.launch import free_port
from nanovllm.harness.run import check_config, config_dir
from nanovllm.server.config import ServerConfig
from nanovllm.serving.loggers import configured_loggers
from nanovllm.serving.metrics import format_summary

logger = logging.getLogger(__name__)


def serve_config(cfg: DictConfig, run_dir: Path) -> int:
    """Check ``cfg``, build the engine, serve HTTP until stopped, write the run's files; the exit status."""
    checked = check_config(cfg)
    server = ServerConfig(**cfg.server)
    if checked.runner["name"] != "real":
        raise ValueError(f"runner={checked.runner['name']}: python -m nanovllm.serve serves the real model "
                         "(runner=real); runner=http is the client side: python -m nanovllm.run runner=http")
    if free_port(server.host, server.port) is None:
        raise ValueError(f"server.port={server.port} on {server.host} is in use; choose another (server.port=0: "
                         "any free port)")

    STOP.starting("importing the engine")
    import uvicorn  # noqa: F401  (imported here, so a missing install fails before the model loads)

    # The engine side (torch, transformers, the model), imported only now: a bad config or a busy port is
    # reported before seconds of imports, and Ctrl-C is already handled (STOP) while they run.
    from nanovllm.harness.live.launch import start_live
    from nanovllm.harness.runners import served_engine
    from nanovllm.serving.monitor import Monitor
    from nanovllm.server.app import ServerState
    from nanovllm.server.http import HTTPServer, uvicorn_config
    from nanovllm.server.prometheus import ServerMetrics

    live = start_live(checked.live, run_dir)
    served = None
    try:
        STOP.starting("starting the engine")
        # One engine, or with cluster.replicas > 1 that many engines in Ray actors behind the router: the
        # routes and the engine loop drive both through the same calls.
        served = served_engine(checked.runner, checked.hardware, checked.engine, cluster=checked.cluster,
                               router=checked.router, plugin_paths=list(cfg.plugins), scheduler=checked.scheduler,
                               allocator=checked.allocator, attention=checked.attention)
        engine = served.engine
        STOP.starting("calibrating the monitor")
        monitor = Monitor.from_config(served.cost, checked.monitor, torch_dtype(engine.config.dtype),
                                      checked.engine.device)
        STOP.starting("starting the loggers")
        loggers = configured_loggers(checked.logger) + live.attach(engine, 0)
        resolved = cast(dict, OmegaConf.to_container(cfg, resolve=True))
        for run_logger in loggers:
            run_logger.start(run_dir, resolved, name=run_dir.name)
    except BaseException:
        live.close()
        if served is not None:
            served.close()
        raise
    model_name = served_model_name(server, cfg.model.path)
    state = ServerState(engine, server, model_name,
                        ServerMetrics(model_name, checked.scheduler["name"], checked.allocator["name"]),
                        loggers=loggers, monitor=monitor, slo=checked.slo)
    http = HTTPServer(uvicorn_config(state, server.host, server.port), state, STOP.event, announce=True)
    STOP.serving("serving HTTP")  # from here a signal stops the server: requests ended, files written
    summary: dict[str, Any] | None = None
    try:
        http.run()
    finally:
        try:
            if state.engine_loop is not None:
                state.engine_loop.stop()
                records, steps = state.engine_loop.records, state.engine_loop.steps
                summary = state.engine_loop.write_summary(
                    {**served.annotations, **served.summary_extras(records, steps),
                     **({"interrupted": True} if STOP.requested else {})})
        finally:
            for run_logger in loggers:
                run_logger.finish()
            live.close()
            served.close()   # real replicas (Ray actors, the Ray instance they started) end with the server
    fault = state.engine_loop.fault if state.engine_loop is not None else None
    return _report(summary, run_dir, fault, http.started, server)


def _report(summary: dict[str, Any] | None, run_dir: Path, fault: str | None, started: bool,
            server: ServerConfig) -> int:
    """Print the server-side summary and where the run's files are, and say how serving ended: the exit status."""
    if summary is not None:
        print(format_summary(summary, title="Serving Result (server side)"))
        if "per_replica" in summary:
            # Only a cluster run's summary has per-replica figures (the harness's cluster module loads Ray's side).
            from nanovllm.harness.cluster import format_per_replica

            print(format_per_replica(summary))
    print(f"run files: {run_dir}")
    if fault is not None:
        print(f"error: the engine failed while serving: {fault}", file=sys.stderr)
        return 1
    if not started:
        print(f"error: the HTTP server did not start on {server.host}:{server.port} (see the log above)",
              file=sys.stderr)
        return 1
    return STOP.exit_status if STOP.requested else 0


def served_model_name(server: ServerConfig, model_path: str | None) -> str:
    """The name clients send as ``model``: ``server.served_model_name``, else ``model.path`` as given (as vLLM
    names a model by its ``--model``), else the default model's name (its GGUF file without the quantization)."""
    from nanovllm.models.loader import DEFAULT_GGUF_FILE   # (the loader imports torch: not for a config error)

    return server.served_model_name or model_path or DEFAULT_GGUF_FILE.split(".")[0]


def _task(cfg: DictConfig) -> None:
    """Hydra's task function: one server (a multirun makes no sense for it)."""
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        _fail("python -m nanovllm.serve runs one server; sweep with python -m nanovllm.run -m (runner=http can "
              "drive a server)")
    STOP.starting("checking the config")
    try:
        status = serve_config(cfg, Path(hc.runtime.output_dir))
    except user_errors() as exc:
        if STOP.requested:
            raise
        _fail(str(exc))
    sys.exit(status)


def _fail(message: str) -> None:
    exit_with_error(message)


def main() -> None:
    """Entry point of ``python -m nanovllm.serve`` (after ``nanovllm/serve.py`` installed the signal handling)."""
    register_configs()
    with one_line_errors():
        check_group_choices(sys.argv[1:], config_dir())
        hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="serve")(_task)()
