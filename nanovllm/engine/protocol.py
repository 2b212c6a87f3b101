"""The engine interface: what a driver may call on anything that serves requests.

A *driver* turns requests into steps: ``LLM.generate``, the Hydra serving loop (``nanovllm.harness.serving``) and
the HTTP server's engine thread (``nanovllm.server.engine_loop``), all through one ``StepLoop``
(``nanovllm.serving.loop``). What it drives is an ``EngineClient``: one ``LLMEngine``, or replicas behind a router
that act as one (``Cluster``, ``DisaggregatedCluster``, ``RayCluster`` in ``nanovllm.cluster``). A driver may use
only what is declared here; a new engine-like thing (a remote engine, a replay) implements this and every driver
serves it unchanged.

The life of a request, as every driver runs it::

    request = client.make_request(prompt, params, arrival_time=t)   # ValueError: refused, naming the field
    client.add_request(request)                                     # or add_request(rejected, error=reason)
    while client.has_unfinished():
        if client.wait_for_step(timeout):                            # False: timeout passed, admit arrivals
            output = client.step()                                   # output.finished: requests that ended

Every request added ends exactly once, reported in some ``step()``'s ``finished``: finished, aborted or failed.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from nanovllm.config import EngineConfig
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.outputs import StepColumns, StepRecord
from nanovllm.request import Request
from nanovllm.sampling import SamplingParams


class StepError(RuntimeError):
    """An engine step raised. The message names the plugin (allocator, attention backend, policy) in whose code
    it happened, when it happened in one, and the step; the engine's state after it is not to be trusted."""


@dataclass
class StepOutput:
    """What one ``step()`` did: the requests that ended in it (finished, aborted, or failed) and its record
    (``start_time`` is the step's start on the client's clock; drivers make it relative to their run)."""

    finished: list[Request]
    record: StepRecord
    plan: SchedulerOutput | None = None   # what the scheduler planned: the batch and the step's preemptions
    # Prefill/decode disaggregation: requests this (prefill) engine prefilled and let go, each with its
    # ``handoff`` (K/V read from the cache, blocks freed), for the cluster to move to a decode replica.
    handed_off: list[Request] = dataclasses.field(default_factory=list)


@dataclass
class StepsAhead:
    """Steps computed ahead, handed out at once (``EngineClient.take_steps_ahead``): their records as columns,
    in runs (``parts``: a cluster's, one a replica's stretch, each in its own order), and the requests that
    ended in them, each with the position of its step among all of them (the parts one after the other), in
    the order ``step()`` would have reported them."""

    parts: list[StepColumns]
    ended: list[tuple[int, Request]] = dataclasses.field(default_factory=list)

    @property
    def steps(self) -> StepColumns:
        """The parts' steps one after the other, as one set of columns."""
        return StepColumns.concatenate(self.parts)

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)


class EngineClient(Protocol):
    """Anything that serves requests, as a driver sees it. Implementations subclass it explicitly.

    The figures below are fixed once the client is built: ``config`` (the engine settings every replica
    shares), ``tokenizer`` and ``hf_config`` (the model's), ``model_dir``, ``max_model_len`` and
    ``num_kv_blocks`` (the limits every request must fit: over replicas, the smallest), ``warmup_time`` /
    ``warmup_steps`` (the warm-up done before the first request, summed over replicas) and ``clock`` (seconds on
    the clock request and step times are given in: the wall clock, or a simulator's virtual one).
    """

    config: EngineConfig
    tokenizer: Any
    hf_config: Any
    model_dir: Path
    max_model_len: int
    num_kv_blocks: int
    warmup_time: float
    warmup_steps: int
    clock: Callable[[], float]

    @abstractmethod
    def make_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None, *,
                     arrival_time: float | None = None, priority: int = 0, client_id: str | None = None,
                     request_id: str | None = None, slo_ttft: float | None = None, slo_e2el: float | None = None,
                     session_id: str | None = None) -> Request:
        """Tokenize and validate a request without adding it; ``ValueError`` naming the bad field.
        ``arrival_time`` defaults to now on ``clock``; ``request_id`` to the next free number. Called by a driver
        as each request arrives; it reads no state a step changes, so the HTTP server calls it on its event
        loop while another thread steps."""

    @abstractmethod
    def rejected_request(self, prompt: str | list, sampling_params: SamplingParams, **fields: Any) -> Request:
        """A ``Request`` for a prompt ``make_request`` refused, to pass to ``add_request(request, error=...)``:
        so that it ends failed, with its reason, through ``step()`` like every other request."""

    @abstractmethod
    def add_request(self, request: Request, error: str | None = None) -> None:
        """Queue ``request`` (a cluster routes it now). With ``error`` it is not run: the next ``step()``
        reports it failed with that reason."""

    @abstractmethod
    def abort_request(self, request_id: str, reason: str = "aborted") -> bool:
        """End a waiting or running request (its blocks freed); a later ``step()`` reports it aborted with
        ``reason``. An unknown or ended id is a no-op returning False, never an error."""

    @abstractmethod
    def abort_all(self, reason: str = "aborted") -> list[str]:
        """Abort every unfinished request; returns their ids (``step()`` reports them, with no model run)."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any added request has not been reported ended yet (a driver steps while this holds)."""

    @abstractmethod
    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) requests now, preempted ones among the waiting: the server's gauges and its
        admission limit read it between steps."""

    @abstractmethod
    def step(self) -> StepOutput:
        """Run (or, for replicas that step on their own, collect) the next step and report what ended in it.
        Called only while ``has_unfinished()``. Raises ``StepError`` (or ``PolicyError``) when a step fails:
        the client's state is not to be trusted after that."""

    def set_horizon(self, t: float | None, upcoming: Sequence[float] = ()) -> None:
        """Called by a driver that knows when its next request comes (the serving loop replaying a workload),
        before each ``step()``: no request is added or aborted before ``t`` on ``clock`` (``math.inf``: none
        will be); ``upcoming``, where given: the times of all the requests still to come, in order (``t`` the
        first). A simulated engine may then compute several steps at once (``LLMEngine.set_horizon``), a
        simulated cluster per replica (``Cluster.set_horizon``). Default: ignored."""
        return None

    def take_steps_ahead(self) -> StepsAhead | None:
        """Called by a driver that keeps its books in bulk, after ``set_horizon`` and instead of ``step()``: the
        records of the next steps, as columns, while they are steps computed ahead (decode stretches of a
        simulated engine: no request starts or arrives in them; requests may end in them), in the order
        ``step()`` would report them, or in any order where ``steps_settled_before`` says when they settle; they
        count as run, and the requests that ended in them come with them. None when the next step is not one
        (then ``step()`` runs it). Default: None."""
        return None

    def steps_settled_before(self) -> float | None:
        """Called by a driver that keeps its books in bulk, between steps: no step this client reports from
        now on (by ``step()`` or ``take_steps_ahead``) starts before the returned time on ``clock``, so the
        records of those reported that start before it are final, and the driver keeps them in order of start
        time, then replica, then the replica's own step number (the order a cluster runs its replicas' steps
        in), and the requests that ended in them in the same order (within a step, as it reported them). None
        (the default): steps are reported in the order they run, and each is kept as it comes. A
        simulated cluster hands out each replica's decode stretch whole, ahead of the other replicas' steps
        (``Cluster.take_steps_ahead``), and says here how far its steps are settled."""
        return None

    def wait_for_step(self, timeout: float | None) -> bool:
        """Block until ``step()`` can return without waiting, or until ``timeout`` seconds passed (None: no
        limit); True when it can. A driver that admits requests between steps calls it with the time to the
        next arrival, so a request for an idle replica need not wait for a busy one's step. A client that
        steps in the caller's thread never waits: a step is always ready while requests are unfinished."""
        return True

    def close(self) -> None:
        """Release what the client holds (processes, a Ray instance) once no driver needs it; idempotent.
        An engine in this process holds nothing to release."""
        return None
