"""Who holds which KV block, every few steps, written only when a run is watched live.

The engine keeps no history, and its step records count blocks but do not say whose they are; the block map
and the Gantt rows of requests still in flight need exactly that. ``SnapshotLogger`` is a ``RunLogger`` that
reads the scheduler's running and waiting queues after every ``every``-th step (a walk over at most
``max_num_seqs`` block tables: microseconds) and appends one line to ``blocks.jsonl`` through
``records.RunWriter``. With ``live=off`` it is not created and the run's files are exactly as before.

A cluster (``cluster.replicas`` > 1) has one block space per replica, and real replicas keep theirs in other
processes: ``ClusterInfoLogger`` writes only ``engine.json`` (every replica's sizes), and the dashboard draws
each replica's batch and KV usage from ``steps.jsonl``, whose records say which replica ran them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import time

from nanovllm.config import head_dim_of, torch_dtype
from nanovllm.engine.engine import LLMEngine
from nanovllm.engine.kv_cache import bytes_per_block
from nanovllm.engine.kv_offload import tier_capacities
from nanovllm.harness.live.feed import cluster_tier_capacities
from nanovllm.request import Request
from nanovllm.serving.loggers import RunLogger
from nanovllm.serving.records import RunWriter


def request_snapshot(request: Request, t0: float) -> dict[str, Any]:
    """One in-flight request: its status, numbers and block table (times relative to the run's ``t0``)."""

    def rel(t: float | None) -> float | None:
        return None if t is None else t - t0

    return {
        "request_id": request.request_id,
        "status": request.status.value,
        "priority": request.priority,
        "client_id": request.client_id,
        "arrival_time": request.arrival_time - t0,
        "first_scheduled_time": rel(request.first_scheduled_time),
        "first_token_time": rel(request.first_token_time),
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_computed_tokens": request.num_computed_tokens,
        "num_output_tokens": request.num_output_tokens,
        "num_preemptions": request.num_preemptions,
        "blocks": list(request.block_table),
    }


MAX_WAITING = 200  # the dashboard shows the latest requests only; a long queue's tail would only cost time


def engine_snapshot(engine: LLMEngine, step: dict, t0: float) -> dict[str, Any]:
    """The requests holding blocks after ``step`` (a run-relative step record) and the head of the waiting
    queue (``MAX_WAITING`` at most; ``num_waiting`` says how many there are)."""
    scheduler = engine.scheduler
    return {
        "step": step["step"],
        "time": step["start_time"] + step["duration"],
        "num_waiting": len(scheduler.waiting),
        "requests": [request_snapshot(r, t0) for r in (*scheduler.running, *scheduler.waiting[:MAX_WAITING])],
    }


def engine_info(engine: LLMEngine, num_requests: int) -> dict[str, Any]:
    """The sizes the dashboard draws against: blocks and their bytes, the batch budgets, the workload size."""
    config, runner = engine.config, engine.runner
    return {
        "num_kv_blocks": engine.num_kv_blocks,
        "block_size": config.block_size,
        "bytes_per_block": bytes_per_block(runner.num_layers, runner.num_kv_heads, runner.head_dim,
                                           config.block_size, runner.dtype, config.kv_cache_dtype),
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "num_requests": num_requests,
        "num_speculative_tokens": (config.speculative or {}).get("num_speculative_tokens"),  # None: off
        # The KV tiers by record name, with their capacity in bytes (None: no kv_offload)
        "kv_tiers": None if engine.offload is None else engine.offload.capacities(),
    }


class SnapshotLogger(RunLogger):
    """Writes ``engine.json`` at start and a block-ownership snapshot every ``every`` steps to ``blocks.jsonl``."""

    def __init__(self, engine: LLMEngine, num_requests: int, every: int = 2) -> None:
        if every < 1:
            raise ValueError(f"live.snapshot_every must be >= 1, got {every}")
        self.engine = engine
        self.num_requests = num_requests
        self.every = every
        self._writer: RunWriter | None = None
        self._t0: float | None = None

    def start(self, run_dir: Path, config: dict, group: str | None = None, name: str | None = None) -> None:
        self._writer = RunWriter.for_extras(run_dir)
        self._writer.write_engine_info(engine_info(self.engine, self.num_requests))

    def log_step(self, step: Mapping[str, Any]) -> None:
        if self._writer is None or step["step"] % self.every:
            return
        if self._t0 is None:
            # Step records are run-relative, requests keep perf_counter times: the step being logged ended
            # moments ago (loggers run right after it), which recovers the run's start to well under a ms.
            self._t0 = time.perf_counter() - (step["start_time"] + step["duration"])
        self._writer.write_blocks(engine_snapshot(self.engine, step, self._t0))

    def finish(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def cluster_info(cluster: Any, num_requests: int) -> dict[str, Any]:
    """``engine_info`` for a cluster: the totals the aggregate charts draw against, and each replica's sizes."""
    replicas = [replica.describe() for replica in cluster.replicas]
    hf = cluster.hf_config
    heads = hf.num_attention_heads
    head_dim = head_dim_of(hf)
    return {
        "num_replicas": len(replicas),
        "num_kv_blocks": sum(r["num_kv_blocks"] for r in replicas),
        "block_size": replicas[0]["block_size"],
        "bytes_per_block": bytes_per_block(hf.num_hidden_layers, getattr(hf, "num_key_value_heads", None) or heads,
                                           head_dim, replicas[0]["block_size"], torch_dtype(cluster.config.dtype)),
        "max_num_seqs": sum(r["max_num_seqs"] for r in replicas),
        "max_num_batched_tokens": sum(r["max_num_batched_tokens"] for r in replicas),
        "num_requests": num_requests,
        "num_speculative_tokens": (cluster.config.speculative or {}).get("num_speculative_tokens"),
        "kv_tiers": cluster_tier_capacities(tier_capacities(cluster.config.kv_offload), len(replicas)) or None,
        "replicas": replicas,
    }


class ClusterInfoLogger(RunLogger):
    """Writes ``engine.json`` for a cluster at start (``cluster_info``); no block snapshots (see the module)."""

    def __init__(self, cluster: Any, num_requests: int) -> None:
        self.cluster = cluster
        self.num_requests = num_requests

    def start(self, run_dir: Path, config: dict, group: str | None = None, name: str | None = None) -> None:
        writer = RunWriter.for_extras(run_dir)
        try:
            writer.write_engine_info(cluster_info(self.cluster, self.num_requests))
        finally:
            writer.close()
