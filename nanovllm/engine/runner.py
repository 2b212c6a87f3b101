"""The runner seam: what turns the scheduler's batch into next tokens, one step at a time.

The engine owns the scheduling (the scheduler, its policy and allocator); a runner owns the model, or whatever
stands in for it. Built-ins, chosen by name (``runner=NAME`` on the command line, ``LLMEngine(runner=...)``):

* ``real``: the model in this process (``engine/model_runner.py``, ``ModelRunner``);
* ``tp``: the model split over ``tensor_parallel_size`` processes (``engine/tp/runner.py``); ``real`` with
  ``tensor_parallel_size > 1`` means ``tp``, as ``attention=auto`` means the device's backend;
* ``sim``: no model: a step-time model predicts each step's duration on a virtual clock (``engine/sim_runner.py``;
  the harness's ``runner=sim`` supplies the step-time models, ``nanovllm.harness.sim``).

A new runner (an HTTP client of an OpenAI-compatible server, say) subclasses ``Runner`` and registers with
``@register_runner("name")``, as a policy does with ``@register_policy``. What the engine asks of it, and when:

1. ``__init__(context, **options)``: once, in ``LLMEngine.__init__``, after the scheduler, allocator and
   attention specs were checked and before anything else is built. ``context`` is what the engine knows then
   (``RunnerContext``); ``options`` are the rest of the ``{"name": ..., **options}`` spec. The runner then
   exposes the geometry the engine sizes the KV cache and the attention backend from: ``device``, ``dtype``,
   ``num_layers``, ``num_heads``, ``num_kv_heads`` (this process's, under tensor parallelism) and ``head_dim``.
2. ``init_kv_cache(num_blocks, block_size, backend, graphs)``: once, after the engine decided how many KV blocks
   there are and built the attention backend (``backend`` is None for a runner that does not ``loads_model``:
   it attends nothing, and the CPU backend would compile kernels it never calls). ``graphs`` (CUDA-graph
   settings) is None unless the runner ``loads_model`` on CUDA and the backend supports graphs.
3. ``execute(scheduled)``: once per engine step that scheduled work (never with an empty batch), between
   ``Scheduler.schedule`` and ``Scheduler.update_from_output``; also during the warm-up, before the first
   request, when ``loads_model``. ``scheduled`` is ``[(request, num_new_tokens)]``; it returns, per row, the
   sampled token (None for a prefill chunk that does not reach the request's newest token) and its top
   logprobs (None unless the request asked for them).
4. ``clock()``: whenever the engine stamps a time (arrivals, the step's start and end). Wall time by default;
   a simulator's virtual clock advances only in ``execute``.
5. ``close()``: when the engine's owner is done with it (idempotent); releases processes or connections.

``supports_speculation`` (a class attribute, False by default) says whether ``execute`` verifies proposals
(speculative decoding, ``nanovllm.proposer``): a scheduled row may then hold proposed tokens after the request's
newest one (``request.spec_token_ids``, as many as ``num_new_tokens`` reaches past ``request.num_tokens``), and
its result is the list of tokens it emits (``nanovllm.engine.speculative.verify_proposals``) with a list of
their logprobs. The engine refuses ``speculative`` with a runner that does not.

``loads_model`` (a class attribute) says whether the runner runs the model on ``engine.device`` in this
process. When it does not (``sim``), the engine skips what only a local model needs: the device's availability,
the attention backend's, the KV-cache memory check, CUDA graphs and the warm-up.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

import torch

from nanovllm.config import EngineConfig
from nanovllm.registry import Registry

if TYPE_CHECKING:
    from nanovllm.attention.base import AttentionBackend
    from nanovllm.engine.kv_offload import KVOffload
    from nanovllm.outputs import Logprob
    from nanovllm.proposer import Proposer, ProposerContext
    from nanovllm.request import Request


@dataclasses.dataclass(frozen=True)
class RunnerContext:
    """What the engine hands a runner it builds: its config, the model's HF config and directory, and the
    attention spec (``auto`` resolved for the device) for runners that build backends of their own."""

    config: EngineConfig
    hf_config: Any
    model_dir: Path
    attention: Any


class Runner(abc.ABC):
    """Runs the scheduled batch of each step; see the module docstring for when the engine calls what."""

    registered_name: str = "custom"
    loads_model: ClassVar[bool] = True
    supports_speculation: ClassVar[bool] = False
    clock: Callable[[], float] = staticmethod(time.perf_counter)

    device: torch.device
    dtype: torch.dtype
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    backend: "AttentionBackend | None" = None   # set by init_kv_cache when the runner attends itself
    model: torch.nn.Module | None = None        # the loaded model, when there is one in this process

    @abc.abstractmethod
    def init_kv_cache(self, num_blocks: int, block_size: int, backend: "AttentionBackend | None",
                      graphs: Any = None) -> None:
        """Allocate (or only note) ``num_blocks`` KV blocks of ``block_size`` tokens, bound to ``backend`` (None
        when the runner does not load a model)."""

    @abc.abstractmethod
    def execute(self, scheduled: list[tuple["Request", int]]) -> tuple[list[int | None],
                                                                       list["dict[int, Logprob] | None"]]:
        """Run one step over ``scheduled``; per row, the next token (or None) and its top logprobs (or None)."""

    def close(self) -> None:
        """Release what the runner holds beyond memory (worker processes, connections); idempotent."""

    def stand_in_proposer(self, context: "ProposerContext") -> "Proposer | None":
        """The proposer to use instead of ``EngineConfig.speculative``'s own, or None (the default: the engine
        builds the configured one). Called once, in ``LLMEngine.__init__``, when speculation is on. The
        simulated runner returns one that proposes stand-in tokens as its acceptance model says, so no draft
        model loads and the speculation policy, the scheduler's budgets and the counters stay the engine's."""
        return None

    def bind_kv_offload(self, offload: "KVOffload") -> None:
        """The engine built KV tiers below the pool (``kv_offload``): called once, in ``LLMEngine.__init__``,
        before the first step. Default: nothing (the real runner's copies take the time they take); the
        simulated runner charges each step the simulated time of what moved between the tiers."""

    # -- prefill/decode disaggregation: the K/V of a request's blocks, out of one engine and into another ------
    def read_kv(self, block_ids: list[int]) -> Any:
        """A copy of the K/V in ``block_ids``, in order (called when a prefilled request leaves a prefill
        replica, before its blocks are freed); None for a runner without a KV tensor (simulated). A runner
        whose cache lives elsewhere (``tp``: in its workers) cannot hand K/V off."""
        raise ValueError(f"runner {self.registered_name!r} cannot read K/V out of its cache, so it cannot serve "
                         "in a prefill/decode disaggregated cluster (use runner real or sim)")

    def write_kv(self, block_ids: list[int], data: Any, first_block: int) -> None:
        """Write blocks ``first_block:`` of ``data`` (a ``read_kv`` result of another replica) into
        ``block_ids`` (called in the decode replica's step that admits the request, before the model runs)."""
        raise ValueError(f"runner {self.registered_name!r} cannot load K/V into its cache (prefill/decode "
                         "disaggregation needs runner real or sim)")

    def check_kv(self, data: Any, num_blocks: int) -> str | None:
        """Why ``data`` (handed to this replica) cannot be loaded for ``num_blocks`` blocks, or None if it can
        (another model, dtype or block size): the request then fails with this reason."""
        return None


RUNNERS: Registry[Runner] = Registry(
    "runner", base=Runner, engine_args=("context",),
    builtin_packages=("nanovllm.engine.model_runner", "nanovllm.engine.sim_runner", "nanovllm.engine.tp.runner"),
)


def register_runner(name: str) -> Callable[[type[Runner]], type[Runner]]:
    """Class decorator registering a ``Runner`` subclass under ``name`` (``runner.name=<name>``)."""
    return RUNNERS.register(name)


REAL, TENSOR_PARALLEL = "real", "tp"


def runner_name(spec: Any) -> str | None:
    """The registered name a runner spec (a name, a ``{"name": ...}`` mapping or an instance) stands for."""
    if isinstance(spec, Runner):
        return spec.registered_name
    if isinstance(spec, Mapping):
        return spec.get("name")
    return spec if isinstance(spec, str) else None


def resolve_runner(spec: Any, config: EngineConfig) -> Any:
    """``spec`` with ``real`` resolved to ``tp`` when the model is split over ranks (``tensor_parallel_size``
    > 1); ``tp`` with one rank is an error naming the field. Anything else is returned as is."""
    name = runner_name(spec)
    if name == REAL and config.tensor_parallel_size > 1:
        return {**spec, "name": TENSOR_PARALLEL} if isinstance(spec, Mapping) else TENSOR_PARALLEL
    if name == TENSOR_PARALLEL and config.tensor_parallel_size == 1 and not isinstance(spec, Runner):
        raise ValueError("runner 'tp' splits the model over tensor_parallel_size ranks, which is 1; set "
                         "tensor_parallel_size > 1 (engine.tensor_parallel_size=2 on the command line)")
    return spec


def runner_class(spec: Any) -> type[Runner]:
    """The class a (resolved) runner spec stands for, checked by the registry: an unknown name or option raises
    the registry's error, listing the registered runners."""
    if isinstance(spec, Runner):
        return type(spec)
    RUNNERS.check(spec)
    name = runner_name(spec)
    if name is None:  # neither a name, a mapping nor an instance: check() passes it on, build() would refuse it
        raise TypeError(f"runner must be a registered name, a {{'name': ...}} mapping or a Runner instance, "
                        f"got {spec!r}")
    return RUNNERS.get(name)
