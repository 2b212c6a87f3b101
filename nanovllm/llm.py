"""The offline facade: ``LLM(...).generate(prompts)`` and ``.chat(messages)``."""

from __future__ import annotations

import contextlib
from typing import Any, Sequence, cast

from nanovllm.chat_template import chat_token_ids
from nanovllm.cluster.config import ClusterConfig
from nanovllm.cluster.disaggregated import pool_routers
from nanovllm.cluster.ray_replicas import RayCluster   # (Ray itself is imported only when a RayCluster starts)
from nanovllm.config import EngineConfig
from nanovllm.engine.engine import LLMEngine, PluginSpec
from nanovllm.engine.protocol import EngineClient
from nanovllm.outputs import RequestMetrics, RequestOutput
from nanovllm.plugins import load_plugins
from nanovllm.progress import RequestProgress
from nanovllm.request import Request
from nanovllm.router import ROUTERS, Router
from nanovllm.sampling import SamplingParams
from nanovllm.serving.loop import StepLoop
from nanovllm.serving.records import RequestRecord

Prompt = str | list[int]


class LLM:
    """An engine on one model. ``engine_options`` are ``EngineConfig`` fields (dtype, device, block_size,
    num_kv_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens, max_model_len,
    enable_chunked_prefill, seed, ...). ``scheduler``, ``allocator`` and ``attention`` take a registered name,
    an instance, or ``{"name": ..., **options}``; ``attention="auto"`` is the C++ ``cpu`` backend on CPU and the
    ``torch`` reference elsewhere. ``plugins``: files or modules to import first (``nanovllm.load_plugins``),
    so the names they register can be chosen here, as ``plugins=[...]`` does for ``python -m nanovllm.run``.

    ``cluster=dict(replicas=N)`` (a ``ClusterConfig`` or its fields: ``replica_overrides``, ``address``) with N > 1
    serves on N real replicas, each an engine in its own Ray actor, behind ``router`` (a registered name, an
    instance, or ``{"name": ..., **options}``): ``generate`` returns what one engine would. A local Ray instance
    is started (and stopped by ``close()`` or at exit) unless ``cluster.address`` names one to join
    (``nanovllm.cluster.ray_replicas``). ``cluster=dict(prefill_replicas=P, decode_replicas=D)``: prefill/decode
    disaggregation (P prefill and D decode replicas, the K/V moved by ``cluster["kv_transfer"]``;
    ``router=dict(prefill=NAME, decode=NAME)`` routes each pool). ``step_time``: the batch-features -> seconds estimate routers that
    predict latency need (``predicted_latency``)."""

    def __init__(
        self,
        model: str | None = None,
        scheduler: PluginSpec = "fcfs",
        allocator: PluginSpec = "paged",
        attention: PluginSpec = "auto",
        plugins: Sequence[str] = (),
        cluster: Any = None,
        router: PluginSpec = "round_robin",
        step_time: Any = None,
        **engine_options,
    ) -> None:
        load_plugins(plugins)
        config = EngineConfig.from_options(model=model, **engine_options)
        replicas = _cluster_config(cluster)
        if replicas is not None and replicas.replicas > 1:
            decode_router: Router | None = None
            if replicas.disaggregated:
                prefill_router, decode_router = pool_routers(router)
            else:
                prefill_router = ROUTERS.build(router)
            engine: EngineClient = RayCluster(
                config, replicas, prefill_router, dict(scheduler=scheduler, allocator=allocator, attention=attention),
                plugin_paths=plugins, step_time=step_time, decode_router=decode_router)
        else:
            engine = LLMEngine(config, scheduler=scheduler, allocator=allocator, attention=attention)
        self._adopt(engine)

    @classmethod
    def from_engine(cls, engine: EngineClient) -> "LLM":
        """An ``LLM`` over an engine built elsewhere (any ``EngineClient``: an ``LLMEngine`` on any runner, the
        simulator's included, or a cluster), so ``generate`` and ``chat`` drive it."""
        llm = cls.__new__(cls)
        llm._adopt(engine)
        return llm

    def _adopt(self, engine: EngineClient) -> None:
        self.engine: EngineClient = engine
        self.tokenizer = engine.tokenizer
        # The records of the latest generate() call only (nanovllm.serving.records: its step records, numbered
        # from 0 with times relative to its start, and its requests in the order they ended): an LLM serving
        # many calls keeps no history.
        self.last_steps: list[dict[str, Any]] = []
        self.last_requests: list[RequestRecord] = []

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priorities: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order. Every request is
        validated before any runs: one bad prompt raises ``ValueError`` and nothing is generated."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts), "sampling_params") if sampling_params is not None \
            else [SamplingParams() for _ in prompts]
        priorities = _per_prompt(priorities, len(prompts), "priorities") if priorities is not None \
            else [0] * len(prompts)
        requests = []
        for i, (prompt, p, prio) in enumerate(zip(prompts, params, priorities)):
            try:
                requests.append(self.engine.make_request(prompt, p, priority=prio))
            except ValueError as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}``) or a list of them, through the chat template."""
        if messages and isinstance(messages[0], dict):
            conversations = [cast(list[dict], messages)]
        else:
            conversations = list(cast(Sequence[list[dict]], messages))
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return chat_token_ids(self.tokenizer, messages)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        for request in requests:
            self.engine.add_request(request)
        with RequestProgress(len(requests), disable=not use_tqdm or len(requests) < 2, desc="generate") as bar:
            loop = StepLoop(self.engine, progress=bar)
            self.last_steps, self.last_requests = loop.steps, loop.requests
            try:
                while self.engine.has_unfinished():
                    loop.step()
            except BaseException:
                # Ctrl-C (or a fault) mid-generate: abort what is left so the engine stays usable for the
                # next call, its blocks free and its queues empty; then let the original exception go on (a
                # second fault while cleaning up must not hide it).
                with contextlib.suppress(Exception):
                    loop.abort_all("interrupted")
                raise
        return [self._output(r) for r in requests]

    def abort_unfinished(self, reason: str = "aborted") -> list[str]:
        """Abort every request this LLM still has waiting or running (their blocks are freed, the policy hears
        ``on_finish``) and report them out of the engine at once. Returns their ids. ``generate`` calls it
        when interrupted; to abort a single request of your own loop use ``llm.engine.abort_request(id)``."""
        return StepLoop(self.engine).abort_all(reason)

    def close(self) -> None:
        """Stop what this LLM started: a cluster's replicas and its Ray instance (an engine holds nothing)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _output(self, r: Request) -> RequestOutput:
        return RequestOutput(
            request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
            text=self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True),
            token_ids=r.output_token_ids, finish_reason=r.finish_reason, logprobs=r.logprobs,
            metrics=RequestMetrics(r.arrival_time, r.first_scheduled_time, r.first_token_time, r.finish_time,
                                   r.num_preemptions, r.num_cached_tokens,
                                   r.handoff.num_bytes if r.handoff is not None else None,
                                   r.handoff.transfer_time if r.handoff is not None else None,
                                   r.num_drafts, r.num_draft_tokens, r.num_accepted_tokens),
        )


def _cluster_config(cluster: Any) -> Any:
    if cluster is None:
        return None

    if isinstance(cluster, ClusterConfig):
        return cluster
    if not isinstance(cluster, dict):
        raise ValueError(f"cluster must be a ClusterConfig or a dict of its fields, e.g. dict(replicas=2), got "
                         f"{cluster!r}")
    return ClusterConfig(**cluster)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; "
                         f"got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise ValueError("prompts must not be empty: give a string, a list of token ids, or a list of those")
    return prompts


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, SamplingParams):
        return [value] * n
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be one value or a list of one per prompt ({n}), got {type(value).__name__}")
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} must be one value or one per prompt ({n}), got {len(value)}")
    return value
