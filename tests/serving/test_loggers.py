"""Loggers: the registry, the files the jsonl logger streams, what an offline W&B run really holds (read back
with wandb's own reader), and the progress bar."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm.serving.loggers import (
    LOGGERS,
    JsonlLogger,
    RunLogger,
    WandbLogger,
    register_logger,
)
from nanovllm.progress import RequestProgress as RunProgress
from nanovllm.serving.metrics import summarize

STEPS = [
    {"step": 0, "start_time": 0.0, "duration": 0.05, "num_prefill_tokens": 12, "num_decode_tokens": 0,
     "num_running": 2, "num_waiting": 1, "kv_blocks_used": 3, "mfu": None},
    {"step": 1, "start_time": 0.05, "duration": 0.01, "num_prefill_tokens": 0, "num_decode_tokens": 2,
     "num_running": 2, "num_waiting": 0, "kv_blocks_used": 4, "mfu": 0.25},
]
REQUESTS = [
    {"request_id": "0", "client_id": None, "priority": 0, "arrival_time": 0.0, "first_scheduled_time": 0.0,
     "first_token_time": 0.05, "finish_time": 0.06, "token_times": [0.05, 0.06], "num_prompt_tokens": 6,
     "num_cached_tokens": 0, "num_output_tokens": 2, "num_preemptions": 0, "finish_reason": "length",
     "error": None},
    {"request_id": "1", "client_id": "b", "priority": 1, "arrival_time": 0.01, "first_scheduled_time": None,
     "first_token_time": None, "finish_time": 0.01, "token_times": [], "num_prompt_tokens": 9000,
     "num_cached_tokens": 0, "num_output_tokens": 0, "num_preemptions": 0, "finish_reason": None,
     "error": "prompt longer than max_model_len"},
]
SUMMARY = {"completed": 1, "request_throughput": 16.5, "mean_ttft_ms": 50.0, "mfu": None}
BREAKDOWNS = {"client_id": {"b": {"completed": 0}, "none": {"completed": 1, "mean_ttft_ms": 50.0}}}
CONFIG = {"model": {"name": "tiny"}, "scheduler": {"name": "fcfs"}, "seed": 7}


def _feed(logger: RunLogger) -> None:
    for step in STEPS:
        logger.log_step(step)
    for record in REQUESTS:
        logger.log_request(record)
    logger.log_summary(SUMMARY, BREAKDOWNS)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_registry_knows_builtins_and_plugins() -> None:
    assert {"jsonl", "wandb"} <= set(LOGGERS.names())
    assert isinstance(LOGGERS.build("jsonl"), JsonlLogger)

    @register_logger("test_null")
    class NullLogger(RunLogger):
        """Logs nothing: every RunLogger method has a do-nothing default."""

    assert LOGGERS.get("test_null") is NullLogger
    with pytest.raises(TypeError):
        register_logger("test_bad")(object)
    with pytest.raises(KeyError, match="jsonl"):
        LOGGERS.get("jsonll")


def test_jsonl_streams_records_and_writes_metrics(tmp_path: Path) -> None:
    logger = LOGGERS.build("jsonl")
    logger.start(tmp_path, CONFIG)
    logger.log_step(STEPS[0])
    # Line-buffered: the step is on disk before the run ends, so a crashed run keeps its records.
    assert _read_jsonl(tmp_path / "steps.jsonl") == [STEPS[0]]
    logger.log_step(STEPS[1])
    for record in REQUESTS:
        logger.log_request(record)
    logger.log_summary(SUMMARY, BREAKDOWNS)
    logger.finish()

    assert _read_jsonl(tmp_path / "steps.jsonl") == STEPS
    assert _read_jsonl(tmp_path / "requests.jsonl") == REQUESTS
    assert json.loads((tmp_path / "metrics.json").read_text()) == {**SUMMARY, "breakdowns": BREAKDOWNS}
    assert json.loads((tmp_path / "config.json").read_text()) == CONFIG


# -- W&B ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def wandb_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep wandb's side files (settings, artifact staging, cache) inside tmp_path, and make the environment
    ask for *disabled* runs: a run that still appears on disk proves the logger's mode="offline" wins."""
    for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def read_wandb_records(run_file: Path) -> list[dict]:
    """Every record of an offline run's ``run-*.wandb`` transaction log, as JSON.

    wandb 0.31 no longer ships the Python ``DataStore`` reader (``wandb.sdk.internal`` kept only a few helpers
    after the move to the Go ``wandb-core`` service); its own reader is now ``wandb leet inspect --json``,
    which prints one JSON object per protobuf ``Record``.
    """
    result = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _offline_run_dir(run_dir: Path) -> Path:
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    return offline


def _final_summary(records: list[dict]) -> dict:
    summary: dict = {}
    for record in records:
        if record["type"] == "summary":
            summary.update(record["summary"].get("update", {}))
    return summary


def test_wandb_offline_run_holds_config_history_summary_and_table(wandb_sandbox: Path) -> None:
    run_dirs = [wandb_sandbox / "run_a", wandb_sandbox / "run_b"]
    loggers = [LOGGERS.build("wandb", tags=["test"]) for _ in run_dirs]
    # Two runs open at once in one process (a sweep or a notebook): each must keep its own records.
    for i, (logger, run_dir) in enumerate(zip(loggers, run_dirs)):
        logger.start(run_dir, {**CONFIG, "seed": i}, group="sweep", name=f"run{i}")
    for logger in loggers:
        _feed(logger)
    for logger in loggers:
        logger.finish()

    for i, run_dir in enumerate(run_dirs):
        # The files of the jsonl logger come along.
        assert _read_jsonl(run_dir / "steps.jsonl") == STEPS
        assert json.loads((run_dir / "metrics.json").read_text())["breakdowns"] == BREAKDOWNS

        offline = _offline_run_dir(run_dir)
        records = read_wandb_records(next(offline.glob("run-*.wandb")))
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        assert run["display_name"] == f"run{i}" and run["run_group"] == "sweep" and run["project"] == "nanovllm"
        assert run["tags"] == ["test"]
        config = run["config"]["update"]
        assert config["model"] == {"name": "tiny"} and config["seed"] == i

        history = [r["history"] for r in records if r["type"] == "history"]
        assert [h["step"].get("num", 0) for h in history] == [0, 1]
        for row, step in zip(history, STEPS):
            assert row["item"]["num_prefill_tokens"] == step["num_prefill_tokens"]
            assert row["item"]["duration"] == pytest.approx(step["duration"])
        assert "mfu" not in history[0]["item"]  # None is left out, not charted as a gap
        assert history[1]["item"]["mfu"] == 0.25

        summary = _final_summary(records)
        assert summary["request_throughput"] == 16.5 and summary["completed"] == 1
        assert summary["breakdowns"] == BREAKDOWNS
        # The per-request table: logged as a table file with one row per request, token_times left out.
        assert summary["requests._type"] == "table-file" and summary["requests.nrows"] == 2
        table = json.loads((offline / "files" / summary["requests.path"]).read_text())
        assert "token_times" not in table["columns"] and "request_id" in table["columns"]
        assert [row[table["columns"].index("request_id")] for row in table["data"]] == ["0", "1"]
        assert records[-1]["type"] == "exit" and records[-1]["exit"].get("exit_code", 0) == 0


def test_wandb_run_summary_holds_the_speculative_decoding_figures(wandb_sandbox: Path) -> None:
    steps = [{**STEPS[1], "kv_blocks_total": 8, "spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 6,
              "spec_decode_num_accepted_tokens": 3, "spec_decode_num_accepted_tokens_per_pos": [2, 1, 0]}]
    logger = LOGGERS.build("wandb")
    logger.start(wandb_sandbox / "spec", CONFIG)
    logger.log_summary(summarize(REQUESTS[:1], steps))
    logger.finish()
    summary = _final_summary(read_wandb_records(next(_offline_run_dir(wandb_sandbox / "spec").glob("run-*.wandb"))))
    assert summary["spec_decode_num_drafts"] == 2 and summary["spec_decode_num_accepted_tokens"] == 3
    assert summary["spec_decode_acceptance_rate"] == 0.5 and summary["spec_decode_mean_accepted_length"] == 2.5
    assert summary["spec_decode_num_accepted_tokens_per_pos"] == [2, 1, 0]


def test_wandb_logger_defaults_to_offline() -> None:
    logger = WandbLogger()
    assert logger.options.mode == "offline" and logger.options.project == "nanovllm"


# -- progress ----------------------------------------------------------------------------------------------------


def test_progress_shows_requests_and_token_rate(capsys: pytest.CaptureFixture[str]) -> None:
    with RunProgress(total_requests=4, disable=False) as progress:
        progress.update(finished_requests=1, output_tokens=10)
        progress.update(finished_requests=4, output_tokens=40)
        assert progress.output_tokens_per_s > 0
    err = capsys.readouterr().err
    assert "4/4" in err and "tok/s" in err


def test_progress_is_silent_when_disabled(capsys: pytest.CaptureFixture[str]) -> None:
    progress = RunProgress(total_requests=4, disable=True)
    progress.update(2, 20)
    progress.close()
    assert capsys.readouterr() == ("", "")


def test_jsonl_survives_odd_config_values(tmp_path: Path) -> None:
    class Policy:
        def __repr__(self) -> str:
            return "<Policy fcfs>"

    logger = JsonlLogger()
    logger.start(tmp_path, {"scheduler": Policy(), "out": tmp_path, "sizes": (1, 2)})
    logger.finish()
    assert json.loads((tmp_path / "config.json").read_text()) == {
        "scheduler": "<Policy fcfs>", "out": str(tmp_path), "sizes": [1, 2]}
