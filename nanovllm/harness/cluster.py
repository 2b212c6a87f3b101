"""Serving a cluster: ``ServedCluster`` is a ``ServedEngine`` whose engine is a ``nanovllm.cluster.Cluster``
(N replicas behind a router), served by the same loop and written to the same files as one engine, with what a
cluster adds: each request's ``replica`` in ``requests.jsonl``, each step's in ``steps.jsonl``, a breakdown
per replica, and the summary's cluster figures (``summary_extras``):

* ``load_imbalance_mean`` / ``load_imbalance_max``: max over mean outstanding requests across replicas, as
  each arriving request found the cluster (1.0 is perfect balance; N is everything on one of N replicas);
* ``per_replica``: per replica, requests routed and completed, prefix-cache hit rate, preemptions, mean and
  peak KV usage, busy fraction (its steps' time over the run's) and mean outstanding requests (real replicas:
  and ``restarts``);
* ``faults`` (real replicas, and simulated ones with ``cluster.faults``): requests resumed after their replica
  died, retries, tokens recomputed for them, requests failed by a death or for lack of a live replica, K/V
  transfers that failed, restarts (``faults_summary``).

Simulated (``runner=sim cluster.replicas=N``): every replica is a ``Simulation`` (the real scheduler, policy
instance and allocator of its own) on its own virtual clock, and the cluster runs them as one discrete-event
simulation (``nanovllm.cluster.cluster``).

Real (``cluster.replicas=N`` with runner ``real``): every replica is an engine in its own Ray actor
(``nanovllm.cluster.ray_replicas.RayCluster``) on the wall clock; the router predicts with this machine's
calibrated step-time profile when there is one for the model (the shipped or ``--this-machine`` one).
"""

from __future__ import annotations

import dataclasses
import statistics
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from nanovllm.cluster import Cluster
from nanovllm.cluster.config import ClusterConfig
from nanovllm.cluster.disaggregated import DisaggregatedCluster, pool_router_specs, pool_routers
from nanovllm.cluster.kv_transfer import KV_TRANSFERS, KVTransfer
from nanovllm.config import EngineConfig, torch_dtype
from nanovllm.engine.engine import PluginSpec
from nanovllm.engine.kv_offload import with_shared_store
from nanovllm.harness.serving import ServedEngine, WallClock
from nanovllm.harness.sim.hardware import Hardware
from nanovllm.harness.sim.simulate import Simulation, simulation_gc
from nanovllm.harness.sim.step_time import STEP_TIME_MODELS
from nanovllm.router import ROUTERS
from nanovllm.serving.formatting import format_value
from nanovllm.serving.monitor import ModelCost
from nanovllm.serving.records import RequestRecord
from nanovllm.serving.step_records import StepTotals


@dataclass
class ServedCluster(ServedEngine):
    """A cluster ready to ``serve``: ``engine`` is the ``Cluster``, ``clock`` its ``ClusterClock``."""

    simulations: list[Simulation]   # empty for real replicas
    breakdown_by: ClassVar[tuple[str, ...]] = ("priority", "client_id", "replica")

    @classmethod
    def simulated(cls, cluster: ClusterConfig, router: PluginSpec, runner: Mapping[str, Any],
                  hardware: Mapping[str, Any] | None, config: EngineConfig, **plugins: PluginSpec) -> "ServedCluster":
        """``cluster.replicas`` simulated replicas (``Simulation.from_config`` each, with its overrides) behind
        ``router`` (a registered name, ``{"name": ..., **options}`` or a ``Router``); the router predicts with
        their shared step-time model (``Simulation.replica``: one tokenizer, HF config and model for all)."""
        # A ``shared`` KV tier: one store for this run's replicas, apart from other runs in this process.
        config = dataclasses.replace(config, kv_offload=with_shared_store(config.kv_offload,
                                                                           f"sim-{uuid.uuid4().hex[:12]}"))
        first = Simulation.from_config(runner, hardware, cluster.engine_config(config, 0), **plugins)
        simulations = [first] + [first.replica(cluster.engine_config(config, index), **plugins)
                                 for index in range(1, cluster.replicas)]
        model = simulations[0].model
        step_time = lambda features: float(model.predict(features, 0.0))  # noqa: E731
        engines = [sim.engine for sim in simulations]

        def restarted(index: int) -> Any:   # a dead replica comes back as a fresh engine: empty queues and cache
            return first.replica(cluster.engine_config(config, index), **plugins).engine

        faults = dict(faults=cluster.faults, max_retries=cluster.max_retries, max_restarts=cluster.max_restarts,
                      step_timeout=cluster.step_timeout, replica_factory=restarted)
        if cluster.disaggregated:
            prefill_router, decode_router = pool_routers(router)
            transfer = simulated_transfer(cluster.kv_transfer, hardware)
            engine: Cluster = DisaggregatedCluster(engines[:cluster.prefill_replicas],
                                                   engines[cluster.prefill_replicas:], prefill_router,
                                                   decode_router, transfer, step_time=step_time, **faults)
        else:
            engine = Cluster(engines, ROUTERS.build(_colocated(router)), step_time=step_time, **faults)
        return cls(engine, engine.clock, simulations[0].cost, simulations)

    @classmethod
    def real(cls, cluster: ClusterConfig, router: PluginSpec, config: EngineConfig, plugin_paths: Sequence[str] = (),
             **plugins: PluginSpec) -> "ServedCluster":
        """``cluster.replicas`` real replicas, each an engine in a Ray actor (``RayCluster``), behind ``router``,
        on the wall clock; the cost model is the HF config's (the driver loads no weights)."""
        from nanovllm.cluster.ray_replicas import RayCluster  # Ray: imported only for real replicas

        if cluster.faults.active:
            raise ValueError("cluster.faults are injected into a simulated cluster (runner=sim); real replicas die "
                             "for real (RayCluster.kill_replica kills one as a crash would)")
        if cluster.disaggregated:
            prefill_router, decode_router = pool_routers(router)
        else:
            prefill_router, decode_router = ROUTERS.build(_colocated(router)), None
        engine = RayCluster(config, cluster, prefill_router, plugins, plugin_paths=plugin_paths,
                            step_time=_machine_step_time(config), decode_router=decode_router)
        cost = ModelCost.from_hf_config(engine.hf_config, torch_dtype(config.dtype), config.kv_cache_dtype,
                                        config.quantization, config.model)
        return cls(engine, WallClock(), cost, [])

    @property
    def cluster(self) -> Cluster:
        return self.engine  # type: ignore[return-value]

    @property
    def annotations(self) -> dict[str, Any]:
        """What ``metrics.json`` gains: the replicas' (simulated, with which step-time model; or the machine real
        ones ran on) and the cluster's shape: replica count, router, each replica's settings."""
        where = self.simulations[0].annotations if self.simulations else super().annotations
        cluster = self.cluster
        settings = [replica.describe() for replica in cluster.replicas]
        extra: dict[str, Any] = {}
        if getattr(cluster, "num_prefill", 0):   # disaggregated: each replica's pool, both routers, the transfer
            for setting in settings:
                setting["pool"] = cluster.pool_of(setting["replica"])  # type: ignore[attr-defined]
            extra = {"prefill_replicas": cluster.num_prefill,  # type: ignore[attr-defined]
                     "decode_replicas": len(cluster.replicas) - cluster.num_prefill,  # type: ignore[attr-defined]
                     "router_decode": cluster.decode_router.registered_name,  # type: ignore[attr-defined]
                     "kv_transfer": cluster.transfer.registered_name}  # type: ignore[attr-defined]
        return {**where, "cluster_replicas": len(cluster.replicas), "router": cluster.router.registered_name,
                **extra, "replica_settings": settings}

    def monitor_config(self, configured: Any) -> Any:
        return self.simulations[0].monitor_config(configured) if self.simulations else configured

    def serve(self, workload: Sequence[Any], **kwargs: Any) -> Any:
        if not self.simulations:
            return super().serve(workload, **kwargs)
        kwargs.setdefault("progress", False)
        with simulation_gc():
            return super().serve(workload, **kwargs)

    def close(self) -> None:
        """Stop real replicas (and the Ray instance they started); nothing for simulated ones."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def summary_extras(self, records: Sequence[RequestRecord], steps: Sequence[dict[str, Any]],
                       totals: StepTotals | None = None) -> dict[str, Any]:
        imbalance = self.cluster.imbalance
        table = per_replica(records, steps, len(self.cluster.replicas), totals)
        extras = {
            "load_imbalance_mean": statistics.fmean(imbalance) if imbalance else None,
            "load_imbalance_max": max(imbalance) if imbalance else None,
            "per_replica": table,
        }
        if not self.simulations or self.cluster.faults.active:   # what replica deaths cost
            restarts = [getattr(replica, "num_restarts", 0) for replica in self.cluster.replicas]
            for index, count in enumerate(restarts):
                table[str(index)]["restarts"] = count
            extras["faults"] = faults_summary(records, restarts, getattr(self.cluster, "num_deaths", 0))
        num_prefill = getattr(self.cluster, "num_prefill", 0)
        if num_prefill:
            extras["disaggregation"] = disaggregation_summary(records, table, num_prefill,
                                                              getattr(self.cluster, "decode_imbalance", []))
        return extras


def _colocated(router: PluginSpec) -> PluginSpec:
    """A router spec without the pool keys (they mean something only with disaggregation)."""
    return pool_router_specs(router)[0]


def simulated_transfer(spec: PluginSpec, hardware: Mapping[str, Any] | None) -> KVTransfer:
    """The ``KVTransfer`` a simulated cluster models K/V moves with. A link preset (``kv_transfer=nvlink``,
    ``infiniband``, ``ethernet``: name ``link``) is used as it is; a real transfer's figures (measured on this
    machine) give way to the simulated hardware's own link (``hardware.kv_link_bandwidth``/``_latency``) when
    a hardware profile names one, since this machine's shared memory says nothing about a GPU's; a transfer
    through a KV tier (``shared_store``) is priced on that tier's link (``hardware.kv_tier_links.shared``)."""
    transfer = KV_TRANSFERS.build(spec)
    link = Hardware.from_config(hardware) if hardware is not None else None
    tier_link = link.kv_tier_links.get(transfer.tier_link or "") if link is not None else None
    if tier_link is not None:   # through a KV tier (shared_store): priced on that tier's link
        transfer.bandwidth, transfer.latency = tier_link["bandwidth"], tier_link["latency"]
    elif transfer.moves_between_processes and link is not None and link.kv_link_bandwidth is not None:
        transfer.bandwidth, transfer.latency = link.kv_link_bandwidth, link.kv_link_latency or 0.0
    return transfer


def _machine_step_time(config: EngineConfig) -> Any:
    """This machine's calibrated step-time estimate for the model, or None when no profile fits it."""
    import logging

    try:
        model = STEP_TIME_MODELS.build({"name": "calibrated", "profile": None, "dtype": config.dtype,
                                        "model": config.model})
    except (ValueError, TypeError) as exc:
        logging.getLogger(__name__).info("no step-time estimate for the router: %s", exc)
        return None
    return lambda features: float(model.predict(features, 0.0))


def disaggregation_summary(records: Sequence[RequestRecord], table: Mapping[str, Mapping[str, Any]],
                           num_prefill: int, decode_imbalance: Sequence[float]) -> dict[str, Any]:
    """What a disaggregated run adds to ``metrics.json``: TTFT split into queueing (arrival to the first
    prefill step) and prefill (to the first token, sampled on the prefill replica); the K/V transfer (bytes,
    seconds) and the wait on the decode replica before its first step there (``decode_queue``); each pool's
    busy fraction and the decode router's load imbalance. Times in ms: mean and p50/p99 over the requests
    that were handed off."""
    import numpy as np

    def stats(values: list[float], name: str) -> dict[str, float | None]:
        array = np.asarray(values, dtype=float) * 1000.0
        return {f"{name}_mean_ms": float(array.mean()) if array.size else None,
                f"{name}_p50_ms": float(np.percentile(array, 50)) if array.size else None,
                f"{name}_p99_ms": float(np.percentile(array, 99)) if array.size else None}

    moved = [r for r in records if r["kv_transfer_bytes"] is not None]
    started = [r for r in records if r["first_scheduled_time"] is not None and r["prefill_replica"] is not None]
    sampled = [r for r in started if r["first_token_time"] is not None]
    queued = [r for r in moved if r["decode_start_time"] is not None and r["kv_arrival_time"] is not None]
    busy = {pool: [row["busy_fraction"] for index, row in table.items() if (int(index) < num_prefill) ==
                   (pool == "prefill")] for pool in ("prefill", "decode")}
    return {
        "prefill_replicas": num_prefill, "decode_replicas": len(table) - num_prefill,
        "handed_off": len(moved),
        "kv_transfer_bytes_total": sum(r["kv_transfer_bytes"] for r in moved),  # type: ignore[misc]
        "kv_transfer_bytes_mean": statistics.fmean(r["kv_transfer_bytes"] for r in moved) if moved else None,
        **stats([r["kv_transfer_time"] for r in moved], "kv_transfer_time"),  # type: ignore[misc]
        **stats([r["first_scheduled_time"] - r["arrival_time"] for r in started], "ttft_queue"),  # type: ignore
        **stats([r["first_token_time"] - r["first_scheduled_time"] for r in sampled], "ttft_prefill"),  # type: ignore
        **stats([r["decode_start_time"] - r["kv_arrival_time"] for r in queued], "decode_queue"),  # type: ignore
        "prefill_pool_busy": statistics.fmean(busy["prefill"]) if busy["prefill"] else None,
        "decode_pool_busy": statistics.fmean(busy["decode"]) if busy["decode"] else None,
        "decode_load_imbalance_mean": statistics.fmean(decode_imbalance) if decode_imbalance else None,
    }


def faults_summary(records: Sequence[RequestRecord], restarts: Sequence[int], deaths: int = 0) -> dict[str, Any]:
    """What ``metrics.json`` says of replica deaths (``RayCluster``, or a simulated cluster's ``cluster.faults``):
    the deaths, requests that resumed on another replica, their retries and the tokens recomputed for them,
    requests that failed because their replica died or no replica was left, failed K/V transfers, and the
    replicas' restarts."""
    retried = [r for r in records if r.get("num_retries")]
    return {"replica_deaths": deaths, "retried_requests": len(retried), "retries": sum(r["num_retries"] for r in retried),
            "retry_recomputed_tokens": sum(r["retry_recomputed_tokens"] for r in retried),
            "failed_replica_died": sum(bool(r["error"] and " died: " in r["error"]) for r in records),
            "failed_no_replica": sum(bool(r["error"] and "no live" in r["error"]) for r in records),
            "kv_transfer_failures": sum(bool(r.get("kv_transfer_failed")) for r in records),
            "replica_restarts": sum(restarts)}


def per_replica(records: Sequence[RequestRecord], steps: Sequence[dict[str, Any]],
                num_replicas: int, totals: StepTotals | None = None) -> dict[str, dict[str, Any]]:
    """Per replica (keyed by its index as a string): its requests, cache hits, preemptions, KV usage and load.
    With disaggregation a request counts on its prefill replica and on its decode replica. ``totals``: the step
    figures over every step, when ``steps`` holds only the records kept (``records.steps``)."""
    duration = max((r["finish_time"] or 0.0 for r in records), default=0.0) or 1.0
    by_replica: dict[int, list[RequestRecord]] = {i: [] for i in range(num_replicas)}
    steps_of: dict[int, list[dict[str, Any]]] = {i: [] for i in range(num_replicas)}
    for record in records:
        if record["replica"] is not None:
            by_replica[record["replica"]].append(record)
        prefill = record.get("prefill_replica")
        if prefill is not None and prefill != record["replica"]:
            by_replica[prefill].append(record)
    for step in steps:
        steps_of[step["replica"]].append(step)
    table: dict[str, dict[str, Any]] = {}
    for index in range(num_replicas):
        mine, its_steps = by_replica[index], steps_of[index]
        prompt = sum(r["num_prompt_tokens"] for r in mine)
        usage = [s["kv_blocks_used"] / s["kv_blocks_total"] for s in its_steps if s["kv_blocks_total"]]
        table[str(index)] = {
            "requests": len(mine),
            "completed": sum(r["error"] is None and r["finish_reason"] in ("stop", "length") for r in mine),
            "prefix_cache_hit_rate": sum(r["num_cached_tokens"] for r in mine) / prompt if prompt else 0.0,
            "num_preemptions": sum(r["num_preemptions"] for r in mine),
            "mean_kv_usage": statistics.fmean(usage) if usage else 0.0,
            "peak_kv_usage": max(usage, default=0.0),
            "busy_fraction": sum(s["duration"] for s in its_steps) / duration,
            "mean_outstanding": (statistics.fmean(s["num_running"] + s["num_waiting"] for s in its_steps)
                                 if its_steps else 0.0),
            "num_steps": len(its_steps),
        }
        if totals is not None:
            table[str(index)].update(totals.replica_figures(index, duration))
    return table


_REPLICA_COLUMNS = [("requests", "requests", "d"), ("done", "completed", "d"),
                    ("hit rate", "prefix_cache_hit_rate", ".3f"), ("preempt", "num_preemptions", "d"),
                    ("mean KV", "mean_kv_usage", ".3f"), ("peak KV", "peak_kv_usage", ".3f"),
                    ("busy", "busy_fraction", ".3f"), ("mean load", "mean_outstanding", ".1f"),
                    ("steps", "num_steps", "d")]


def format_per_replica(summary: Mapping[str, Any]) -> str:
    """A console table of ``summary["per_replica"]`` with the load imbalance under it."""
    table = summary.get("per_replica") or {}
    header = ["replica"] + [label for label, _, _ in _REPLICA_COLUMNS]
    rows = [[index] + [format_value(stats[key], spec) for _, key, spec in _REPLICA_COLUMNS]
            for index, stats in table.items()]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(text.rjust(w) for text, w in zip(row, widths)) for row in [header, *rows]]
    imbalance = (f"load imbalance (max/mean outstanding at arrivals): mean "
                 f"{format_value(summary.get('load_imbalance_mean'), '.3f')}, max "
                 f"{format_value(summary.get('load_imbalance_max'), '.3f')}")
    split = summary.get("disaggregation")
    if split:   # prefill/decode pools: where the first token's time went, the transfer, each pool's load
        imbalance += (f"\ndisaggregated ({split['prefill_replicas']} prefill + {split['decode_replicas']} decode): "
                      f"p50 TTFT queue {format_value(split['ttft_queue_p50_ms'], '.1f')} ms + prefill "
                      f"{format_value(split['ttft_prefill_p50_ms'], '.1f')} ms; KV transfer p50 "
                      f"{format_value(split['kv_transfer_time_p50_ms'], '.2f')} ms, "
                      f"{format_value((split['kv_transfer_bytes_mean'] or 0) / 1e6, '.2f')} MB a request; decode "
                      f"queue p50 {format_value(split['decode_queue_p50_ms'], '.1f')} ms; busy prefill "
                      f"{format_value(split['prefill_pool_busy'], '.2f')} / decode "
                      f"{format_value(split['decode_pool_busy'], '.2f')}")
    faults = summary.get("faults")
    if faults and (faults["retries"] or faults["failed_replica_died"] or faults["replica_restarts"]
                   or faults.get("replica_deaths")):
        imbalance += (f"\nreplica deaths: {faults.get('replica_deaths', 0)}; {faults['retried_requests']} requests "
                      f"resumed elsewhere "
                      f"({faults['retries']} retries, {faults['retry_recomputed_tokens']} tokens recomputed), "
                      f"{faults['failed_replica_died']} failed, {faults['replica_restarts']} restarts")
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:], imbalance])
