"""Real replicas: each one an ``LLMEngine`` in its own Ray actor (its own process, model and KV cache), behind
the router in the driver. ``RayCluster`` is the same engine-like facade as the simulated ``Cluster`` (its
``_route`` is that class's: the same views, checks and router calls), so ``LLM.generate`` and the harness's
``serve`` drive it unchanged.

The step. Every replica with work has exactly one ``ReplicaActor.run`` call in flight: it adds the requests
routed to it since its last call, runs one engine step and returns plain data (the step's record, the requests
that ended, the replica's state). ``step()`` waits for the first call of any replica to come back, sends that
replica its next call at once (its new requests with it), and returns the step as one engine's ``StepOutput``
with ``record["replica"]``. So replicas step concurrently in their processes while the loop in the driver
sees one step at a time, in the order they end. A request routed while every replica is mid-step is routed at
its arrival (its view is the one the router gets) and joins its replica's next step, as a request arriving
during a step of one engine does.

Views. A replica's view is its last reported state (running, waiting, free blocks, queued tokens, decoding,
recent TTFT/ITL) plus what the driver routed to it since (those requests count as waiting, their prompts as
queued tokens). ``prefix_match_tokens`` reads a driver-side mirror of the replica's prefix cache: each call
returns the keys (``prefix_block_key``) of the blocks its allocator caches that were added and removed in the
step (``BlockAllocator.cached_block_keys``), and a lookup hashes the request's full blocks once per route and
walks each replica's key set: no round trip, at most one step stale. An allocator that does not expose its
keys reports none (``prefix_match_tokens`` 0). With KV tiers (``kv_offload``) each call also returns each
tier's added and removed keys (``KVTier.keys``), and the walk goes on past the pool through the tiers, as the
replica's own ``Scheduler.cached_prefix_len`` does, into a ``CachedPrefix`` split by tier (what tier-aware
routers read); a ``shared`` tier is one store, so a key any replica reported is in it for all. An entry another
replica removed from the shared store counts until a replica that listed it looks it up (a miss there).

Time. Arrival times cross as perf_counter seconds of the driver. Processes on one machine share that clock
(CLOCK_MONOTONIC); an actor on another node gets an offset measured once with a round trip (NTP-style, error
under half a round trip), which the driver adds to what it sends and takes off what comes back.

Deaths. A call that fails because its actor is gone (``ray.kill``, a crash, a lost node) marks the replica
dead (its view ``alive=False``, so routers skip it; its router hears ``on_finish`` for each request it held).
Each of those requests is routed again among the live replicas of its pool (a decode replica's to a decode
replica) and resumes there from the driver's copy: its prompt plus every token the driver has seen (which is
what a streaming client has seen), recomputed there as that engine's prompt, no K/V moved; it keeps its id,
tokens, token times and sampling params, and ``max_tokens`` counts what it generated already, so the client
gets each token once. A seeded request's sampler starts again from its seed (its state died with the actor).
Its ``retried_from`` lists the replicas it was on, ``retry_recomputed_tokens`` what they had computed. It fails
with "replica N died: ..." only when it was retried ``cluster.max_retries`` times or no replica of its pool is
alive (one model-free step record of the dead replica reports what ended); an abort on its way to the dead
replica ends its request aborted. With ``cluster.max_restarts`` the replica's actor is relaunched (same index
and settings) and rejoins the router once its ``info`` answers; while no replica of a pool is alive, its
requests (a dead replica's, arrivals, hand-offs) wait in a relaunching replica's queue (``_parking_spot``) and
an arrival with none coming back fails with the reason. An exception raised by the engine inside a
live actor is re-raised in the driver as it was (a plugin bug ends the run, as on one engine).

Lifetime. With no address, a local Ray instance (127.0.0.1, no dashboard) is started and stopped with the
cluster; ``address="auto"`` or ``ray://...`` joins a running one (then only this cluster's actors are
stopped). ``close()`` kills the actors and shuts down what it started; a finalizer does the same when the
cluster is collected or the interpreter exits (normally, on an exception, after Ctrl-C).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import sys
import time
import types
import weakref
from collections import Counter, deque
from pathlib import Path
from typing import Any, Mapping, Sequence, cast

from nanovllm.allocator import prefix_block_keys
from nanovllm.cluster.cluster import ClusterBase
from nanovllm.cluster.config import ClusterConfig
from nanovllm.cluster.faults import death_record
from nanovllm.cluster.kv_transfer import KV_TRANSFERS, KVTransfer, fit_handoff
from nanovllm.cluster.replica import LocalReplica
from nanovllm.config import EngineConfig
from nanovllm.engine.engine import LLMEngine, PluginSpec
from nanovllm.engine.kv_offload import CachedPrefix
from nanovllm.engine.protocol import StepOutput
from nanovllm.outputs import StepRecord
from nanovllm.request import Request, RequestStatus
from nanovllm.router import ReplicaView, Router, StepTimeEstimate
from nanovllm.sampling import SamplingParams

START_TIMEOUT_S = 600.0   # how long the replicas may take to start and load the model


class ReplicaActor:
    """One replica in its Ray actor: an engine, and the running figures a view needs (``LocalReplica``'s)."""

    def __init__(self, index: int, config: EngineConfig, plugins: Mapping[str, PluginSpec],
                 plugin_paths: Sequence[str], threads: int, view_index: int | None = None,
                 kv_transfer: Any = None) -> None:
        import torch

        from nanovllm.cluster.kv_transfer import KV_TRANSFERS
        from nanovllm.plugins import load_plugins

        torch.set_num_threads(threads)
        load_plugins(list(plugin_paths))
        self.engine = LLMEngine(config, **plugins)
        self.replica = LocalReplica(index, self.engine, view_index)
        # Prefill/decode disaggregation: how this replica sends K/V it prefilled, or receives K/V to decode.
        self.transfer = KV_TRANSFERS.build(kv_transfer) if kv_transfer is not None else None
        self._keys: set[int] = set()
        self._tier_keys: dict[str, set[int]] = {}   # each KV tier's keys as last reported (tier name -> keys)
        self._sent: dict[str, int] = {}   # request id -> output tokens already reported (``progress``)

    def info(self) -> dict[str, Any]:
        import ray

        engine = self.engine
        return {"describe": self.replica.describe(), "max_model_len": engine.max_model_len,
                "num_kv_blocks": engine.num_kv_blocks, "block_size": engine.config.block_size,
                "max_logprobs": engine.max_logprobs, "warmup_time": engine.warmup_time,
                "warmup_steps": engine.warmup_steps, "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "state": self._state(),
                "tiers": [] if engine.offload is None else [
                    (name, tier.registered_name) for name, tier in zip(engine.offload.names, engine.offload.tiers)]}

    def clock(self) -> float:
        return self.engine.clock()

    def close(self) -> None:
        """The cluster is closing: close the engine (its KV tiers remove what they must not leave behind, e.g.
        a shared store's blocks with ``persist=false``)."""
        self.engine.close()

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        """What this replica's allocator itself says of a prompt (what the driver's mirror must agree with)."""

        request = Request("probe", list(token_ids), SamplingParams(), 0.0)
        return self.engine.allocator.cached_prefix_len(request)

    def cached_prefix_by_tier(self, token_ids: list[int]) -> dict[str, int]:
        """What this replica's scheduler says of a prompt, its KV tiers included, by tier (what the driver's
        mirror of the pool and the tiers must agree with)."""

        match = self.engine.scheduler.cached_prefix_len(Request("probe", list(token_ids), SamplingParams(), 0.0))
        by_tier = getattr(match, "by_tier", None)
        return dict(by_tier) if by_tier is not None else {"primary": int(match)}

    def run(self, new: list[dict[str, Any]], abort: str | None,
            aborts: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
        """Add ``new`` requests (plain data), abort everything when ``abort`` says why and each of ``aborts``
        (request id, reason), run one step. Returns its record, the requests that ended, every live request's
        tokens new since the last call (``progress``: what a streaming server sends on) and the state."""
        engine = self.engine
        for spec in new:
            fields = {key: spec[key] for key in ("arrival_time", "priority", "client_id", "request_id", "slo_ttft",
                                                "slo_e2el", "session_id")}
            error = spec["error"]
            if error is None:
                try:
                    request = engine.make_request(spec["prompt_token_ids"], spec["sampling_params"], **fields)
                except ValueError as exc:
                    error = str(exc)
            if error is None and spec.get("handoff") is not None:
                error = self._receive(request, spec)
                if error is None:
                    continue
            if error is None and spec.get("resume") is not None:
                # Its replica died: it goes on here from its prompt and the tokens it generated there, all of
                # them recomputed as this engine's prompt (as after a preemption), and the driver has them.
                _restore(request, spec["resume"])
                self._sent[request.request_id] = request.num_output_tokens
            if error is not None:
                request = engine.rejected_request(spec["prompt_token_ids"], spec["sampling_params"], **fields)
            request.replica = self.replica.index
            request.hand_off_after_prefill = bool(spec.get("hand_off"))
            self.replica.add(request, error=error)
        if abort is not None:
            engine.abort_all(abort)
        for request_id, reason in aborts:
            engine.abort_request(request_id, reason)
        if not engine.has_unfinished():
            return {"record": None, "finished": [], "progress": [], "handed_off": [], "state": self._state()}
        output = self.replica.step()
        for request in (*output.finished, *output.handed_off):
            self._sent.pop(request.request_id, None)
        return {"record": dict(output.record), "finished": [_ended(r) for r in output.finished],
                "progress": self._progress(), "handed_off": [self._send(r) for r in output.handed_off],
                "state": self._state()}

    def _send(self, request: Request) -> dict[str, Any]:
        """A request this prefill replica handed off: its K/V sent (``KVTransfer.send``), its state as plain data."""
        handoff = request.handoff
        assert handoff is not None and self.transfer is not None
        started = time.perf_counter()
        try:
            handle, error = self.transfer.send_request(self.engine, request, handoff.data), None
        except Exception as exc:  # noqa: BLE001 -- this request fails with the reason; the others go on
            handle, error = None, f"kv transfer ({self.transfer.registered_name}) failed to send: {exc}"
        handoff.transfer_time += time.perf_counter() - started
        handoff.data = None
        plain = _ended(request)
        plain.update(handle=handle, send_error=error, generator_state=(
            request.generator.get_state() if request.generator is not None else None))
        return plain

    def _receive(self, request: Request, spec: Mapping[str, Any]) -> str | None:
        """Queue a handed-off request on this decode replica with the K/V it receives, or say why it cannot."""
        from nanovllm.request import KVHandoff

        moved = spec["handoff"]
        if self.transfer is None:
            return f"replica {self.replica.index} is not a decode replica (no kv_transfer)"
        started = time.perf_counter()
        data, failed = None, bool(moved.get("failed"))
        if not failed:
            try:
                data = self.transfer.receive_request(self.engine, request, moved["handle"])
            except Exception as exc:  # noqa: BLE001 -- KVTransferError, or a transfer plugin's own failure
                # The K/V are lost, the request is not: this replica computes its prompt (and first token) itself.
                logging.getLogger(__name__).warning(
                    "request %s: kv transfer (%s) failed to receive (%s); recomputing its prompt here",
                    request.request_id, self.transfer.registered_name, exc)
                failed = True
        _restore(request, spec)
        request.handoff = KVHandoff(prefill_replica=moved["prefill_replica"], num_tokens=moved["num_tokens"],
                                    num_bytes=moved["num_bytes"], data=data,
                                    prefill_end_time=moved["prefill_end_time"],
                                    transfer_time=moved["transfer_time"] + time.perf_counter() - started,
                                    failed=failed)
        if data is not None:   # a prefix of the blocks sent may have come (a store lost the rest)
            fit_handoff(request.handoff, data, self.engine.config.block_size)
        request.replica = self.replica.index
        self.replica.add_handed_off(request)
        self._sent[request.request_id] = request.num_output_tokens   # the driver has the first token already
        return None

    def _progress(self) -> list[tuple[str, list[int], list | None, int, list[float], float | None]]:
        """(id, new output tokens, their logprobs, cached prompt tokens, the new tokens' times, first scheduled
        time) of each unfinished request that has tokens the driver has not seen: at most ``max_num_seqs``
        running ones, plus preempted ones (none new). The times let a request whose replica dies resume with
        them elsewhere."""
        progress = []
        for request in self.engine.scheduler.running:
            sent = self._sent.get(request.request_id, 0)
            if request.num_output_tokens > sent:
                new = request.output_token_ids[sent:]
                logprobs = request.logprobs[sent:] if request.logprobs else None
                progress.append((request.request_id, new, logprobs, request.num_cached_tokens,
                                 request.token_times[sent:], request.first_scheduled_time))
                self._sent[request.request_id] = request.num_output_tokens
        return progress

    def _state(self) -> dict[str, Any]:
        scheduler, allocator, replica = self.engine.scheduler, self.engine.allocator, self.replica
        keys = allocator.cached_block_keys()
        added: list[int] = []
        removed: list[int] = []
        if keys is not None:
            added, removed = list(keys - self._keys), list(self._keys - keys)
            self._keys = keys
        return {"num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
                "num_free_blocks": allocator.num_free_blocks(), "num_total_blocks": allocator.num_blocks,
                "num_queued_tokens": replica.num_queued_tokens, "num_decoding": replica.num_decoding,
                "recent_ttft": replica.recent_ttft, "recent_itl": replica.recent_itl,
                "keys_added": added, "keys_removed": removed, "tier_keys": self._tier_changes()}

    def _tier_changes(self) -> dict[str, tuple[list[int], list[int]]]:
        """Per KV tier, the keys (``prefix_block_key``) it gained and lost since the last report: the driver
        mirrors each replica's tiers as it mirrors its pool, so a route reads tier-aware matches locally."""
        offload = self.engine.offload
        if offload is None:
            return {}
        changes = {}
        for name, tier in zip(offload.names, offload.tiers):
            keys, before = tier.keys(), self._tier_keys.get(name, set())
            changes[name] = (list(keys - before), list(before - keys))
            self._tier_keys[name] = keys
        return changes


_RESTORED = ("first_scheduled_time", "first_token_time", "num_cached_tokens", "num_preemptions",
             "num_recomputed_tokens", "max_computed_tokens", "logprobs")


def _restore(request: Request, spec: Mapping[str, Any]) -> None:
    """A fresh actor-side ``request`` as far as it had gone elsewhere (a prefill replica, or a replica that died):
    its generated tokens, their times, its counters and (when sent) its sampler's state."""
    request.token_ids = list(request.prompt_token_ids) + list(spec["output_token_ids"])
    for key in _RESTORED:
        setattr(request, key, spec[key])
    request.token_times = list(spec["token_times"])
    if spec.get("generator_state") is not None and request.generator is not None:
        request.generator.set_state(spec["generator_state"])


def _ended(request: Request) -> dict[str, Any]:
    """What the driver needs of a request that ended in an actor (times on the actor's clock)."""
    return {"request_id": request.request_id, "output_token_ids": request.output_token_ids,
            "status": request.status.value, "num_computed_tokens": request.num_computed_tokens,
            "num_cached_tokens": request.num_cached_tokens, "num_preemptions": request.num_preemptions,
            "num_recomputed_tokens": request.num_recomputed_tokens,
            "max_computed_tokens": request.max_computed_tokens,
            # KV tiers: where its cached tokens came from, and what swapping brought back (request records)
            "num_cached_tokens_by_tier": request.num_cached_tokens_by_tier,
            "num_swapped_tokens": request.num_swapped_tokens,
            "first_scheduled_time": request.first_scheduled_time, "first_token_time": request.first_token_time,
            "finish_time": request.finish_time, "token_times": request.token_times,
            "finish_reason": request.finish_reason, "error": request.error, "logprobs": request.logprobs,
            "handoff": _handoff_plain(request.handoff)}


def _handoff_plain(handoff: Any) -> dict[str, Any] | None:
    if handoff is None:
        return None
    return {key: getattr(handoff, key) for key in ("prefill_replica", "num_tokens", "num_bytes", "prefill_end_time",
                                                   "transfer_time", "arrival_time", "decode_start_time", "loaded",
                                                   "failed")}


class _Frontend:
    """The engine's own request checks (``LLMEngine.make_request`` and the methods it calls) on the limits a
    replica reported: the driver tokenizes and validates without a model of its own."""

    make_request = LLMEngine.make_request
    rejected_request = LLMEngine.rejected_request
    _validate_tokens = LLMEngine._validate_tokens
    _best_effort_tokens = LLMEngine._best_effort_tokens

    def __init__(self, info: Mapping[str, Any], tokenizer: Any, hf_config: Any, runner: Any) -> None:
        self.tokenizer, self.runner, self.clock = tokenizer, runner, time.perf_counter
        self.max_model_len, self.num_kv_blocks = info["max_model_len"], info["num_kv_blocks"]
        self.max_logprobs, self.vocab_size = info["max_logprobs"], hf_config.vocab_size
        eos = hf_config.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        # BlockAllocator.blocks_for's formula (the engine checks a request against its cache with it).
        self.allocator = types.SimpleNamespace(blocks_for=lambda n, size=info["block_size"]: -(-n // size))
        self._ids = itertools.count()


class RemoteReplica:
    """The driver's side of one actor: its last reported state, what was routed to it since, its in-flight
    call and the requests it holds (by id)."""

    def __init__(self, index: int, actor: Any, info: Mapping[str, Any], offset: float,
                 view_index: int | None = None) -> None:
        self.index, self.actor, self.info, self.offset = index, actor, info, offset
        self.view_index = index if view_index is None else view_index   # its position in its pool's views
        self.alive = True
        self.num_routed = 0
        self.state: dict[str, Any] = dict(info["state"])
        self.keys: set[int] = set(self.state.pop("keys_added"))
        self.state.pop("keys_removed")
        # Its KV tiers, top first: (name, registered name); each tier's keys (the cluster's mirror: RayCluster).
        self.tiers: list[tuple[str, str]] = [tuple(tier) for tier in info.get("tiers", [])]  # type: ignore[misc]
        self.tier_keys: dict[str, set[int]] = {name: set() for name, _ in self.tiers}
        self.held: dict[str, Request] = {}              # request id -> request, until it ends
        self.unsent: list[tuple[Request, str | None]] = []
        self.sending: list[Request] = []                # the (accepted) requests of the call in flight
        self.in_flight: Any = None                      # its ObjectRef
        self.sent_at = 0.0                              # when it was sent (time.monotonic; cluster.step_timeout)
        self.abort: str | None = None
        self.aborts: list[tuple[str, str]] = []         # (request id, reason) for the next call
        # The aborts the call in flight carries: if the actor dies with it, those requests end aborted.
        self.aborting: tuple[str | None, list[tuple[str, str]]] = (None, [])
        self.resumes: set[str] = set()                  # ids in ``unsent`` that resume (their replica died)
        self.num_restarts = 0                           # actors relaunched for this replica
        self.starting: Any = None                       # a relaunched actor's ``info`` ObjectRef, until it answers
        self._view: ReplicaView | None = None

    def describe(self) -> dict[str, Any]:
        return dict(self.info["describe"])

    def has_unfinished(self) -> bool:
        return bool(self.held)

    def view(self, request: Request, lookup: Any) -> ReplicaView:
        if self._view is None:
            state, config = self.state, self.info["describe"]
            transit = self.sending + [r for r, error in self.unsent if error is None]
            self._view = ReplicaView(
                index=self.view_index, alive=self.alive, num_running=state["num_running"],
                num_waiting=state["num_waiting"] + len(transit), num_free_blocks=state["num_free_blocks"],
                num_total_blocks=state["num_total_blocks"], block_size=config["block_size"],
                num_queued_tokens=state["num_queued_tokens"] + sum(r.num_prompt_tokens for r in transit),
                num_decoding=state["num_decoding"], max_num_seqs=config["max_num_seqs"],
                max_num_batched_tokens=config["max_num_batched_tokens"], recent_ttft=state["recent_ttft"],
                recent_itl=state["recent_itl"], num_routed=self.num_routed,
                prefix_lookup=lambda r: lookup(self, r))
        return self._view.bind(request)

    def send(self) -> None:
        """The next call: the requests routed since the last one, and the abort if one was asked."""
        new = [_plain(request, error, self.offset, request.request_id in self.resumes)
               for request, error in self.unsent]
        self.sending = [request for request, error in self.unsent if error is None]
        self.unsent, self.resumes = [], set()
        self.in_flight = self.actor.run.remote(new, self.abort, self.aborts)
        self.sent_at = time.monotonic()
        self.aborting = (self.abort, self.aborts)
        self.abort, self.aborts = None, []


def _plain(request: Request, error: str | None, offset: float, resume: bool = False) -> dict[str, Any]:
    """``request`` as the actor's ``run`` takes it: with ``resume``, as far as the driver has followed it on a
    replica that died (recomputed, no K/V); else with the K/V handed off to it, if any."""
    plain = {"request_id": request.request_id, "prompt_token_ids": list(request.prompt_token_ids),
             "sampling_params": request.sampling_params, "arrival_time": request.arrival_time + offset,
             "priority": request.priority, "client_id": request.client_id, "slo_ttft": request.slo_ttft,
             "slo_e2el": request.slo_e2el, "session_id": request.session_id, "error": error,
             "hand_off": request.hand_off_after_prefill, "handoff": None, "resume": None}
    handoff = request.handoff
    if resume:   # the driver's copy, as far as the client has seen it; max_computed 0: a retry's recompute
        plain["resume"] = {"output_token_ids": request.output_token_ids,
                           "token_times": [t + offset for t in request.token_times],
                           "first_scheduled_time": _shift(request.first_scheduled_time, offset),
                           "first_token_time": _shift(request.first_token_time, offset),
                           "num_cached_tokens": request.num_cached_tokens, "num_preemptions": request.num_preemptions,
                           "num_recomputed_tokens": request.num_recomputed_tokens, "max_computed_tokens": 0,
                           "logprobs": request.logprobs}
    elif handoff is not None and not handoff.loaded:   # to a decode replica: the request so far and its K/V
        plain["handoff"] = {"handle": handoff.data, "failed": handoff.failed,
                            "prefill_replica": handoff.prefill_replica,
                            "num_tokens": handoff.num_tokens, "num_bytes": handoff.num_bytes,
                            "transfer_time": handoff.transfer_time,
                            "prefill_end_time": _shift(handoff.prefill_end_time, offset)}
        plain.update(output_token_ids=request.output_token_ids, token_times=[t + offset for t in request.token_times],
                     first_scheduled_time=_shift(request.first_scheduled_time, offset),
                     first_token_time=_shift(request.first_token_time, offset),
                     num_cached_tokens=request.num_cached_tokens, num_preemptions=request.num_preemptions,
                     num_recomputed_tokens=request.num_recomputed_tokens,
                     max_computed_tokens=request.max_computed_tokens, logprobs=request.logprobs,
                     generator_state=handoff.sampler_state)
    return plain


def _shift(t: float | None, offset: float) -> float | None:
    return None if t is None else t + offset


class RayCluster(ClusterBase):
    """``replicas`` real engines in Ray actors behind ``router``; see the module docstring."""

    def __init__(self, config: EngineConfig, cluster: ClusterConfig, router: Router,
                 plugins: Mapping[str, PluginSpec] | None = None, plugin_paths: Sequence[str] = (),
                 step_time: StepTimeEstimate | None = None, decode_router: Router | None = None) -> None:
        """``router`` routes every request (with ``cluster.prefill_replicas``: the prefill pool's, and
        ``decode_router`` the decode pool's; ``nanovllm.cluster.disaggregated.pool_routers`` builds both)."""
        if cluster.address is None:
            # A local instance serves this machine only: its daemons and workers on the loopback address
            # (Ray otherwise advertises the machine's outward address). Read when ray is first imported.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray
        import torch
        from transformers import AutoConfig, AutoTokenizer

        from nanovllm.models.loader import resolve_model

        self.router = router
        self.num_prefill = cluster.prefill_replicas   # 0: colocated replicas
        self.transfer: KVTransfer | None = None
        self.decode_router = decode_router
        if self.num_prefill:
            if decode_router is None or decode_router is router:
                raise ValueError("a disaggregated RayCluster needs a decode_router of its own (pool_routers)")
            self.transfer = KV_TRANSFERS.build(cluster.kv_transfer)
            if not self.transfer.moves_between_processes:
                raise ValueError(f"kv_transfer {self.transfer.registered_name!r} works within one process only; "
                                 "real replicas are processes: use kv_transfer=shared_memory or ray")
            for index in range(cluster.replicas):
                self.transfer.check(cluster.engine_config(config, index))
            if config.tensor_parallel_size > 1:
                raise ValueError("prefill/decode disaggregation reads K/V out of one process's cache: "
                                 "tensor_parallel_size must be 1")
        for each in (router, decode_router):
            if step_time is not None and each is not None:
                each.bind_step_time(step_time)
        self.imbalance: list[float] = []
        self.decode_imbalance: list[float] = []
        self._reports: deque[StepOutput] = deque()
        self._last_keys: tuple[Request | None, list[int]] = (None, [])
        self.max_retries, self.max_restarts = cluster.max_retries, cluster.max_restarts
        self.step_timeout = cluster.step_timeout
        self._started = _start_ray(cluster.address, cluster.replicas)
        actors: list[Any] = []   # every actor started, relaunched ones included (the finalizer stops them)
        self._actors = actors
        self._finalizer = weakref.finalize(self, _stop, actors, self._started)
        try:
            threads = max(1, _cpus(self._started) // cluster.replicas)
            env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                os.environ.get("PYTHONPATH")])),
                   "OMP_NUM_THREADS": str(threads)}
            # Ray does not restart an actor itself: a relaunch (``max_restarts``) is this cluster's, so the
            # driver knows when the replica is back and its requests have gone elsewhere meanwhile.
            self._actor_class = ray.remote(ReplicaActor).options(num_cpus=threads, max_restarts=0,
                                                                  max_task_retries=0, runtime_env={"env_vars": env})
            paths = [str(Path(p).resolve()) if Path(p).exists() else p for p in plugin_paths]
            self._actor_args = [(index, cluster.engine_config(config, index), dict(plugins or {}), paths, threads,
                                 self._view_index(index), cluster.kv_transfer if self.num_prefill else None)
                                for index in range(cluster.replicas)]
            for args in self._actor_args:
                actors.append(self._actor_class.remote(*args))
            self.model_dir = resolve_model(config.model)
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            self.hf_config = AutoConfig.from_pretrained(self.model_dir)
            infos = _gather([actor.info.remote() for actor in actors], "start")
        except BaseException:
            self._finalizer()
            raise
        node = ray.get_runtime_context().get_node_id()
        self.replicas = [RemoteReplica(index, actor, info, 0.0 if info["node_id"] == node else _offset(actor),
                                       self._view_index(index))
                         for index, (actor, info) in enumerate(zip(actors, infos))]
        # A shared KV tier is one store: a key any replica reports holding is in it for every replica (how many
        # replicas report each key; what one evicts is gone for all, and its report removes it).
        self._shared_keys: Counter[int] = Counter()
        for replica in self.replicas:
            self._mirror_tiers(replica, replica.state.pop("tier_keys"))
        # What the request checks read of a runner: a device for seeded generators (the model stays in the actors).
        runner = types.SimpleNamespace(device=torch.device("cpu"))
        self.clock = time.perf_counter
        self.config = config
        limits: dict[tuple[int, int, int], _Frontend] = {}
        for info in infos:
            key = (info["max_model_len"], info["num_kv_blocks"], info["block_size"])
            limits.setdefault(key, _Frontend(info, self.tokenizer, self.hf_config, runner))
        self._validators = list(limits.values())
        # The longest request and the smallest KV cache every replica takes (the router may send it to any).
        self.max_model_len = min(validator.max_model_len for validator in self._validators)
        self.num_kv_blocks = min(validator.num_kv_blocks for validator in self._validators)
        self.warmup_time = sum(info["warmup_time"] for info in infos)
        self.warmup_steps = sum(info["warmup_steps"] for info in infos)

    def _view_index(self, index: int) -> int:
        """Replica ``index``'s position in its pool (the decode pool's views count from 0)."""
        return index - self.num_prefill if self.num_prefill and index >= self.num_prefill else index

    def _router_of(self, replica: RemoteReplica) -> Router:
        """The router of ``replica``'s pool (the cluster's one router when replicas are colocated)."""
        return self._pool(replica.index)[1]

    def pool_of(self, index: int) -> str | None:
        """"prefill" or "decode" (None: colocated replicas)."""
        if not self.num_prefill:
            return None
        return "prefill" if index < self.num_prefill else "decode"

    # -- requests ----------------------------------------------------------------------------------------------
    def add_request(self, request: Request, error: str | None = None) -> None:
        """Route ``request`` (a relaunched replica that has started rejoins first) and queue it on its replica."""
        self.poll_restarts()
        now = request.arrival_time
        request.hand_off_after_prefill = bool(self.num_prefill)
        pool = self._pool(0)[0]
        spot = None if any(replica.alive for replica in pool) else self._parking_spot(pool)
        if spot is None and not any(replica.alive for replica in pool):
            self._fail_no_replica(request, pool, now)   # rather than the router's error stopping the loop
            return
        index = self._route(request, now) if spot is None else spot.index
        replica = self.replicas[index]
        request.replica = index
        replica.num_routed += 1
        replica.held[request.request_id] = request
        replica.unsent.append((request, error))
        replica._view = None
        self._ask("on_arrival", request, replica.view_index, now)
        if replica.in_flight is None and replica.alive:
            replica.send()

    def has_unfinished(self) -> bool:
        return bool(self._reports) or any(replica.held for replica in self.replicas)

    def abort_request(self, request_id: str, reason: str = "aborted") -> bool:
        """End ``request_id`` on its replica (it is reported by that replica's next step, as on one engine).
        An unknown or already-ended id is a no-op and returns False."""
        for replica in self.replicas:
            if replica.alive and request_id in replica.held:
                replica.aborts.append((request_id, reason))
                if replica.in_flight is None:
                    replica.send()
                return True
            if request_id in replica.held:   # waiting for its replica's relaunch: it ends here, now
                self._abort_parked(replica, [request_id], reason)
                return True
        return False

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) over the live replicas as they last reported, plus what was routed since."""
        running = waiting = 0
        for replica in self.replicas:
            if replica.alive:
                running += replica.state["num_running"]
                waiting += replica.state["num_waiting"] + len(replica.sending) + len(replica.unsent)
        return running, waiting

    def abort_all(self, reason: str = "aborted") -> list[str]:
        ids: list[str] = []
        for replica in self.replicas:
            if replica.alive and replica.held:
                ids += list(replica.held)
                replica.abort = reason
                if replica.in_flight is None:
                    replica.send()
            elif replica.held:   # waiting for its replica's relaunch
                ids += list(replica.held)
                self._abort_parked(replica, list(replica.held), reason)
        return ids

    def _abort_parked(self, replica: RemoteReplica, request_ids: list[str], reason: str) -> None:
        """End requests waiting for ``replica``'s relaunch as aborted now (nothing of theirs is in any actor but
        K/V sent ahead, which is freed); the next ``step`` reports them."""
        now = time.perf_counter()
        ended = []
        for request_id in request_ids:
            request = replica.held.pop(request_id)
            replica.unsent = [(r, e) for r, e in replica.unsent if r.request_id != request_id]
            replica.resumes.discard(request_id)
            handoff = request.handoff
            if handoff is not None and not handoff.loaded and handoff.data is not None and self.transfer:
                self.transfer.discard(handoff.data)
                handoff.data = None
            request.status, request.error, request.finish_reason = RequestStatus.ABORTED, reason, "abort"
            request.finish_time = now
            self._ask("on_finish", request, replica.view_index, now, router=self._router_of(replica))
            ended.append(request)
        replica._view = None
        self._reports.append(StepOutput(ended, death_record(replica.index, now, 0)))

    def view_keys(self, request: Request) -> list[int]:
        """The prefix-block keys of ``request``'s prompt, hashed once per route (every replica's lookup)."""
        last, keys = self._last_keys
        if last is not request:
            keys = prefix_block_keys(request.token_ids, self.config.block_size)
            self._last_keys = (request, keys)
        return keys

    def _mirror_tiers(self, replica: RemoteReplica, changes: Mapping[str, tuple[list[int], list[int]]]) -> None:
        """Apply what ``replica`` reported of its KV tiers' keys (added, removed) to the driver's mirror."""
        shared = {name for name, kind in replica.tiers if kind == "shared"}
        for name, (added, removed) in changes.items():
            keys = replica.tier_keys.setdefault(name, set())
            removed = [key for key in removed if key in keys]
            added = [key for key in added if key not in keys]
            keys.difference_update(removed)
            keys.update(added)
            if name in shared:
                self._shared_keys.update(added)
                for key in removed:
                    self._shared_keys[key] -= 1
                    if self._shared_keys[key] <= 0:
                        del self._shared_keys[key]

    def _prefix_match(self, replica: RemoteReplica, request: Request) -> int:
        """``request``'s cached prefix on ``replica`` from the driver's mirrors: its pool, then block by block the
        first of its KV tiers holding the next one (a shared tier: any replica's report), as its scheduler's
        ``cached_prefix_len`` counts it (a ``CachedPrefix``, by tier, when it has tiers). No round trip; what
        each replica reported at its last step."""
        keys, block_size = self.view_keys(request), replica.info["block_size"]
        matched = 0
        for key in keys:
            if key not in replica.keys:
                break
            matched += 1
        if not replica.tiers:
            return matched * block_size
        by_tier = {"primary": matched * block_size, **{name: 0 for name, _ in replica.tiers}}
        levels = [(name, None if kind == "shared" else replica.tier_keys[name]) for name, kind in replica.tiers]
        for key in keys[matched:]:
            holder = next((name for name, own in levels
                           if (self._shared_keys[key] > 0 if own is None else key in own)), None)
            if holder is None:
                break
            by_tier[holder] += block_size
        return CachedPrefix(by_tier)

    def _route(self, request: Request, now: float) -> int:
        """The router's choice (with disaggregation: the prefill router's, among the prefill replicas)."""
        pool = self.replicas[:self.num_prefill] if self.num_prefill else self.replicas
        views = [replica.view(request, self._prefix_match) for replica in pool]
        return self._choose(request, views, now)

    def _hand_off(self, prefill: RemoteReplica, plain: Mapping[str, Any], now: float) -> Request | None:
        """A request ``prefill`` handed off: follow it in the driver, route it to a decode replica and queue it
        there with its K/V's handle. Returns it when it cannot go on (its send failed: it ends failed here)."""
        from nanovllm.request import KVHandoff

        request = prefill.held.pop(plain["request_id"])
        _finish(request, plain, prefill.offset)
        request.status = RequestStatus.HANDED_OFF
        moved = plain["handoff"]
        request.handoff = KVHandoff(prefill_replica=prefill.index, num_tokens=moved["num_tokens"],
                                    num_bytes=moved["num_bytes"], data=plain["handle"],
                                    prefill_end_time=_shift(moved["prefill_end_time"], -prefill.offset),
                                    transfer_time=moved["transfer_time"], sampler_state=plain["generator_state"])
        self._ask("on_finish", request, prefill.view_index, now)
        if plain["send_error"] is not None:   # nothing was sent: the decode replica computes the prompt itself
            logging.getLogger(__name__).warning("request %s: %s; its decode replica recomputes the prompt",
                                                request.request_id, plain["send_error"])
            request.handoff.failed, request.handoff.data = True, None
        pool = self.replicas[self.num_prefill:]
        spot = None if any(replica.alive for replica in pool) else self._parking_spot(pool)
        if spot is None and not any(replica.alive for replica in pool):
            if self.transfer is not None and plain["handle"] is not None:
                self.transfer.discard(plain["handle"])
            request.status, request.finish_time = RequestStatus.FAILED, now
            request.error = "no live decode replica is left to hand the request off to"
            return request
        if spot is None:
            views = [replica.view(request, self._prefix_match) for replica in pool]
            local = self._choose(request, views, now, self.decode_router, self.decode_imbalance)
        else:   # its K/V wait in the transfer for the relaunched decode replica
            local = spot.view_index
        decode = pool[local]
        request.replica = decode.index
        decode.num_routed += 1
        decode.held[request.request_id] = request
        decode.unsent.append((request, None))
        decode._view = None
        self._ask("on_arrival", request, local, now, router=self.decode_router)
        if decode.in_flight is None and decode.alive:
            decode.send()
        return None

    # -- the step --------------------------------------------------------------------------------------------
    def next_ready_time(self) -> float | None:
        return time.perf_counter() if self.has_unfinished() else None

    def wait_for_step(self, timeout: float | None) -> bool:
        """Wait until a replica reports a step (or a dead replica's failed requests are to be reported), at
        most ``timeout`` seconds. Replicas step on their own, so a serving loop that admits requests between
        steps waits only until its next arrival: a request for an idle replica need not wait for a busy one."""
        import ray
        from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

        while not self._reports:
            flights = {replica.in_flight: replica for replica in self.replicas if replica.in_flight is not None}
            starting = {replica.starting: replica for replica in self.replicas if replica.starting is not None}
            if not flights and not starting:
                raise RuntimeError("RayCluster: waited for a step with no replica holding a request")
            wait = timeout
            if self.step_timeout is not None and flights:   # wake up when the oldest call in flight is overdue
                overdue_in = min(r.sent_at for r in flights.values()) + self.step_timeout - time.monotonic()
                wait = max(0.0, overdue_in) if wait is None else min(wait, max(0.0, overdue_in))
            ready, _ = ray.wait(list(flights) + list(starting), num_returns=1, timeout=wait)
            if not ready:
                if self._kill_hung(flights.values()):
                    continue
                if wait == timeout:
                    return False
                continue
            if ready[0] in starting:   # a relaunched replica answered: it takes requests from now on
                self._rejoin(starting[ready[0]])
                continue
            replica = flights[ready[0]]
            replica.in_flight = None
            try:
                result = ray.get(ready[0])
            except RayTaskError as exc:   # the engine raised inside a live actor: as one engine's step would
                cause = getattr(exc, "cause", None)
                if isinstance(cause, Exception):
                    raise cause from None
                raise
            except (RayActorError, OutOfMemoryError) as exc:
                if isinstance(exc, OutOfMemoryError):   # Ray's memory monitor killed the actor's worker
                    with contextlib.suppress(Exception):
                        ray.kill(replica.actor, no_restart=True)
                self._died(replica, exc)
                continue
            output = self._apply(replica, result)
            if replica.held or replica.unsent:
                replica.send()
            if output is not None:
                self._reports.append(output)
        return True

    def step(self) -> StepOutput:
        """The next step any replica reports (or a dead replica's failed requests), as one engine's."""
        self.wait_for_step(None)
        return self._reports.popleft()

    def _apply(self, replica: RemoteReplica, result: Mapping[str, Any]) -> StepOutput | None:
        state = dict(result["state"])
        replica.keys.difference_update(state.pop("keys_removed"))
        replica.keys.update(state.pop("keys_added"))
        self._mirror_tiers(replica, state.pop("tier_keys"))
        replica.state, replica.sending, replica._view, replica.aborting = state, [], None, (None, [])
        if result["record"] is None:
            return None
        offset = replica.offset
        for request_id, tokens, logprobs, cached, times, scheduled in result["progress"]:
            request = replica.held.get(request_id)
            if request is not None:   # the driver's copy follows the actor's, token by token
                request.token_ids.extend(tokens)
                request.token_times.extend(t - offset for t in times)
                if logprobs is not None:
                    request.logprobs = (request.logprobs or []) + list(logprobs)
                request.num_cached_tokens = cached
                if request.first_token_time is None and request.token_times:
                    request.first_token_time = request.token_times[0]
                if request.first_scheduled_time is None and scheduled is not None:
                    request.first_scheduled_time = scheduled - offset
        finished = []
        for plain in result["finished"]:
            request = replica.held.pop(plain["request_id"])
            _finish(request, plain, offset)
            finished.append(request)
        now = time.perf_counter()
        router = self._router_of(replica)
        for request in finished:
            self._ask("on_finish", request, replica.view_index, now, router=router)
        for plain in result.get("handed_off", []):
            failed = self._hand_off(replica, plain, now)
            if failed is not None:
                finished.append(failed)
        # The actor's StepRecord came across as a plain dict; on the driver's clock from here.
        record = cast(StepRecord, dict(result["record"]))
        record["start_time"] -= offset
        record["replica"] = replica.index
        return StepOutput(finished, record)

    def _died(self, replica: RemoteReplica, exc: BaseException) -> None:
        """``replica``'s actor is gone: routers skip it; each request it held resumes on a live replica of its
        pool (``_retry``), or ends: aborted if an abort was on its way to it, failed with the reason when it has
        been retried ``max_retries`` times or no replica is left; the actor is relaunched if restarts remain."""
        replica.alive, replica._view = False, None
        reason = f"replica {replica.index} died: {_first_line(exc)}"
        now = time.perf_counter()
        held = list(replica.held.values())
        replica.held.clear()
        replica.unsent, replica.sending, replica.resumes = [], [], set()
        abort_all = replica.abort or replica.aborting[0]
        aborted = dict(replica.aborting[1] + replica.aborts)
        replica.abort, replica.aborts, replica.aborting = None, [], (None, [])
        for request in held:
            handoff = request.handoff
            if handoff is not None and not handoff.loaded and handoff.data is not None and self.transfer:
                self.transfer.discard(handoff.data)   # K/V sent to it and never received: free them
                handoff.data = None
        if replica.num_restarts < self.max_restarts:   # first: the only replica of a pool is where its
            self._relaunch(replica)                     # requests wait (``_parking_spot``)
        # What every cluster does with a dead replica's requests (the simulated one too): ClusterBase._recover.
        failed = self._recover(replica, held, reason, now, aborted, abort_all)
        record = death_record(replica.index, now, replica.state["num_total_blocks"])
        self._reports.append(StepOutput(failed, record))

    def _kill_hung(self, replicas: Any) -> bool:
        """Treat every replica whose call has been in flight longer than ``cluster.step_timeout`` as dead: its
        actor is killed (a hung process may never answer) and its requests resume elsewhere (``_died``).
        True when one was."""
        import ray

        if self.step_timeout is None:
            return False
        now, killed = time.monotonic(), False
        for replica in list(replicas):
            if replica.in_flight is not None and now - replica.sent_at >= self.step_timeout:
                replica.in_flight = None
                with contextlib.suppress(Exception):   # already gone
                    ray.kill(replica.actor, no_restart=True)
                self._died(replica, TimeoutError(f"no step within cluster.step_timeout={self.step_timeout:g} s"))
                killed = True
        return killed

    def _retry_views(self, pool: Sequence[Any], request: Request, now: float) -> list[Any]:
        self._last_keys = (None, [])   # its tokens grew since it was routed: hash them again
        return [replica.view(request, self._prefix_match) for replica in pool]

    def _resume_on(self, target: Any, request: Request, now: float) -> None:
        """Queue a dead replica's ``request`` on ``target``: it goes with the target's next call (a relaunched
        target's first, once it rejoins), as far as the driver has followed it (prompt and generated tokens,
        recomputed there; no K/V)."""
        target.num_routed += 1
        target.held[request.request_id] = request
        target.unsent.append((request, None))
        target.resumes.add(request.request_id)
        target._view = None
        if target.in_flight is None and target.alive:
            target.send()

    def _parking_spot(self, pool: Sequence[Any]) -> Any:
        """A replica of ``pool`` being relaunched (None if none is): with no live replica in its pool, an
        arrival, a dead replica's request or a hand-off waits in its queue and goes with its first call once it
        rejoins, rather than failing while a restart is on its way."""
        return next((replica for replica in pool if replica.starting is not None), None)

    def _relaunch(self, replica: RemoteReplica) -> None:
        """Start a new actor for dead ``replica`` (same index and settings); it rejoins once its ``info``
        answers (``_rejoin``), meanwhile routers see it dead."""
        replica.num_restarts += 1
        replica.actor = self._actor_class.remote(*self._actor_args[replica.index])
        self._actors.append(replica.actor)
        replica.starting = replica.actor.info.remote()
        logging.getLogger(__name__).warning("replica %d died; relaunching it (restart %d of %d)", replica.index,
                                            replica.num_restarts, self.max_restarts)

    def _rejoin(self, replica: RemoteReplica) -> None:
        """``replica``'s relaunched actor answered (or failed to start: relaunched again while restarts remain)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        ref, replica.starting = replica.starting, None
        try:
            info = ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            logging.getLogger(__name__).warning("replica %d failed to restart: %s", replica.index, _first_line(exc))
            if replica.num_restarts < self.max_restarts:
                self._relaunch(replica)
            elif replica.held:   # what waited for it resumes elsewhere or ends, as for a death
                self._died(replica, exc)
            return
        replica.info = info
        state = dict(info["state"])
        replica.keys = set(state.pop("keys_added"))
        state.pop("keys_removed")
        self._mirror_tiers(replica, {name: ([], list(keys)) for name, keys in replica.tier_keys.items()})
        self._mirror_tiers(replica, state.pop("tier_keys"))   # the new actor's tiers (its shared one adopts the store)
        replica.state, replica._view = state, None
        node = ray.get_runtime_context().get_node_id()
        replica.offset = 0.0 if info["node_id"] == node else _offset(replica.actor)
        replica.alive = True
        if replica.held and replica.in_flight is None:   # what waited for it (``_parking_spot``) goes now
            replica.send()

    def poll_restarts(self, timeout: float = 0.0) -> list[int]:
        """Rejoin the relaunched replicas whose actors have started, waiting at most ``timeout`` seconds for all
        of them; returns the indices that rejoined. Called at every ``add_request`` and while a step is awaited,
        so a replica rejoins the router as soon as it answers; a caller may call it to wait for one."""
        import ray

        starting = {replica.starting: replica for replica in self.replicas if replica.starting is not None}
        if not starting:
            return []
        ready, _ = ray.wait(list(starting), num_returns=len(starting), timeout=timeout)
        for ref in ready:
            self._rejoin(starting[ref])
        return [starting[ref].index for ref in ready if starting[ref].alive]

    # -- lifetime ----------------------------------------------------------------------------------------------
    def kill_replica(self, index: int) -> None:
        """Kill replica ``index``'s actor (as a crash would): the driver finds out when its call in flight (or
        its next one) fails, and its requests resume elsewhere (``_died``)."""
        import ray

        ray.kill(self.replicas[index].actor, no_restart=True)

    def close(self) -> None:
        """Close the live replicas' engines (each after its step in flight), then stop the actors and the Ray
        instance this cluster started (idempotent)."""
        if self._finalizer.alive:
            import ray

            live = [replica.actor for replica in self.replicas if replica.alive]
            with contextlib.suppress(Exception):   # a dead or hung actor: killed below all the same
                ray.get([actor.close.remote() for actor in live], timeout=30)
        self._finalizer()

    def __enter__(self) -> "RayCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _finish(request: Request, plain: Mapping[str, Any], offset: float) -> None:
    """The driver's ``request`` as it ended in the actor."""

    def back(t: float | None) -> float | None:
        return None if t is None else t - offset

    request.token_ids = list(request.prompt_token_ids) + list(plain["output_token_ids"])
    request.status = RequestStatus(plain["status"])
    for key in ("num_computed_tokens", "num_cached_tokens", "num_preemptions", "num_recomputed_tokens",
                "max_computed_tokens", "num_cached_tokens_by_tier", "num_swapped_tokens", "finish_reason", "error",
                "logprobs"):
        setattr(request, key, plain[key])
    request.first_scheduled_time = back(plain["first_scheduled_time"])
    request.first_token_time = back(plain["first_token_time"])
    request.finish_time = back(plain["finish_time"])
    request.token_times = [t - offset for t in plain["token_times"]]
    moved = plain.get("handoff")
    if moved is not None and request.handoff is not None:   # decoded here after a hand-off: its figures
        handoff = request.handoff
        handoff.transfer_time, handoff.loaded, handoff.data = moved["transfer_time"], moved["loaded"], None
        handoff.failed = moved["failed"]
        handoff.arrival_time, handoff.decode_start_time = back(moved["arrival_time"]), back(moved["decode_start_time"])


# -- Ray ----------------------------------------------------------------------------------------------------------

def _start_ray(address: str | None, replicas: int) -> bool:
    """Connect to Ray; True when this call did it (so ``close`` disconnects, stopping a local instance)."""
    import ray

    if ray.is_initialized():
        return False
    if address is None:
        ray.init(num_cpus=max(os.cpu_count() or 1, replicas), include_dashboard=False, log_to_driver=True,
                 logging_level=logging.WARNING)
    else:
        ray.init(address=address, logging_level=logging.WARNING)
    return True


def _cpus(local: bool) -> int:
    """The cores the replicas share: this machine's for a local instance, the cluster's CPUs otherwise."""
    import ray

    cores = os.cpu_count() or 1
    if local:
        return cores
    return int(ray.cluster_resources().get("CPU", cores))


def _gather(refs: list[Any], what: str) -> list[Any]:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(refs, timeout=START_TIMEOUT_S)
    except GetTimeoutError:
        raise RuntimeError(f"the replicas did not {what} within {START_TIMEOUT_S:.0f} s (not enough CPUs "
                           "for their actors in the Ray cluster?)") from None
    except (RayActorError, RayTaskError) as exc:
        cause = getattr(exc, "cause", None) or getattr(exc, "error_msg", None) or exc
        if isinstance(cause, ValueError):
            raise cause from None
        raise RuntimeError(f"a replica failed to {what}: {_first_line(cause)}") from None


def _offset(actor: Any) -> float:
    """The actor's perf_counter minus the driver's, from the round trip with the smallest delay of five."""
    import ray

    best: tuple[float, float] = (math.inf, 0.0)   # (round trip, offset)
    for _ in range(5):
        sent = time.perf_counter()
        theirs = ray.get(actor.clock.remote())
        back = time.perf_counter()
        if back - sent < best[0]:
            best = (back - sent, theirs - (sent + back) / 2)
    return best[1]


def _stop(actors: list[Any], started: bool) -> None:
    try:
        import ray

        if not ray.is_initialized():
            return
        for actor in actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
        if started:
            ray.shutdown()
    except Exception as exc:  # noqa: BLE001 -- at exit, say it and go on
        print(f"nanovllm: stopping the Ray replicas failed: {exc}", file=sys.stderr)


def _first_line(exc: Any) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


__all__ = ["RayCluster", "ReplicaActor", "RemoteReplica"]
