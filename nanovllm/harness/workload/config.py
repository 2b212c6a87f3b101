"""Workload configs (they double as Hydra structured configs: fields of simple types only) and the
request type every workload source produces. Each config validates itself when constructed."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.harness.workload.validation import validate_workload_config


@dataclass
class WorkloadRequest:
    """One request of a workload: when it arrives (seconds from run start) and what it asks for."""

    arrival_time: float
    prompt: str | list[int]             # text, or token ids (synthetic and chat workloads give ids)
    max_tokens: int
    priority: int = 0
    client_id: str | None = None
    ignore_eos: bool = False
    request_id: str | None = None
    messages: list[dict] | None = None  # the chat it came from; `prompt` then holds the templated ids
    ttft_slo_ms: float | None = None    # this request's own TTFT target (scheduler=edf orders by it)
    e2el_slo_ms: float | None = None    # this request's own end-to-end latency target
    session_id: str | None = None       # the conversation it belongs to (multi-turn workloads; routers may pin it)


@dataclass
class LengthDist:
    """A distribution of token lengths, always clipped to ``[min, max]``.

    * ``fixed``: always ``round(mean)``.
    * ``uniform``: integers in ``[mean*(1-range_ratio), mean*(1+range_ratio)]`` (like vllm bench's random data).
    * ``lognormal``: ``exp(N(mu, sigma))`` with ``mu`` chosen so the (unclipped) mean is ``mean``.
    * ``zipf``: ``round(s * k)`` with ``k ~ Zipf(alpha)`` (heavy tail: most requests short, a few very long);
      the scale ``s`` is solved so the mean *after* clipping is ``mean`` (some (alpha, mean, max) are
      unreachable -- alpha near 1 with a small mean -- and fail validation).
    """

    kind: str = "fixed"
    mean: float = 128
    range_ratio: float = 0.0
    sigma: float = 0.5
    alpha: float = 1.5
    min: int = 1
    max: int = 4096


@dataclass
class SyntheticWorkloadConfig:
    """Synthetic arrivals and lengths. ``request_rate=inf`` puts every arrival at t=0 (an offline batch)."""

    name: str = "synthetic"
    num_requests: int = 64
    request_rate: float = float("inf")
    burstiness: float = 1.0
    input_len: LengthDist = field(default_factory=LengthDist)
    output_len: LengthDist = field(default_factory=LengthDist)
    prompt_kind: str = "random"         # "random" token ids, or "text" cut from the chat dataset
    num_prefix_groups: int = 0          # >0: each prompt = one of these shared prefixes + its own suffix
    prefix_len: int = 0
    priority_classes: list[int] = field(default_factory=lambda: [0])
    priority_weights: list[float] = field(default_factory=lambda: [1.0])
    num_clients: int = 1
    client_rate_shares: list[float] | None = None  # None: every client gets an equal share
    ttft_slo_ms: list[float] | None = None  # per-request TTFT target, one per entry of priority_classes
    e2el_slo_ms: list[float] | None = None  # per-request end-to-end target, one per entry of priority_classes
    ignore_eos: bool = True             # so each request really produces its sampled output length
    seed: int = 0

    def __post_init__(self) -> None:
        validate_workload_config(self)


@dataclass
class ChatWorkloadConfig:
    """Prompts from the shipped chat dataset, chat-templated; EOS ends requests naturally."""

    name: str = "chat"
    num_requests: int = 32
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_tokens: int = 128
    priority_classes: list[int] = field(default_factory=lambda: [0])
    priority_weights: list[float] = field(default_factory=lambda: [1.0])
    num_clients: int = 1
    client_rate_shares: list[float] | None = None
    ttft_slo_ms: list[float] | None = None  # per-request TTFT target, one per entry of priority_classes
    e2el_slo_ms: list[float] | None = None  # per-request end-to-end target, one per entry of priority_classes
    seed: int = 0

    def __post_init__(self) -> None:
        validate_workload_config(self)


@dataclass
class MultiTurnWorkloadConfig:
    """Multi-turn conversations (``nanovllm.harness.workload.conversations``): ``num_sessions`` sessions of
    ``turns`` turns each; every turn's prompt is the conversation so far (an optional shared system prompt,
    every earlier user message and reply, the new user message), so it starts with the previous turn's prompt.

    ``request_rate`` is the long-run mean rate of *requests* (turns) per second, as for the other workloads:
    sessions start by a gamma process (``burstiness``; 1 = Poisson) at ``request_rate / turns.mean`` sessions/s,
    ``inf`` starts every session at t=0. Turn k+1 arrives ``reply_len * reply_time_per_token_s`` (the time its
    reply is assumed to take) plus an exponential think time of mean ``think_time_s`` after turn k.

    ``working_set_tokens`` (a controllable working set): the number of sessions becomes what holds about that
    many tokens of conversation (``expected_session_tokens`` each, ``num_sessions`` is then ignored), and the
    turns arrive as one process at ``request_rate``, each the next turn of a session drawn at random among those
    with turns left: the same conversations are revisited whatever the rate, so the cache footprint is set by
    this number alone. ``tool_output_len`` (agentic sessions, ``workload=agentic``): from the second turn on,
    each turn appends a tool output of this length before its user message, the way an agent's context grows
    by long tool results between short steps.
    """

    name: str = "multi_turn"
    num_sessions: int = 8
    request_rate: float = float("inf")  # requests/s on average (see above); inf = every session starts at t=0
    burstiness: float = 1.0
    turns: LengthDist = field(default_factory=lambda: LengthDist(kind="fixed", mean=4, max=64))
    user_len: LengthDist = field(default_factory=lambda: LengthDist(mean=32))   # tokens of each user message
    reply_len: LengthDist = field(default_factory=lambda: LengthDist(mean=32))  # each turn's max_tokens
    think_time_s: float = 1.0           # mean (exponential) pause between a reply and the next user message
    reply_time_per_token_s: float = 0.02  # how long a reply is assumed to take, per token (open loop)
    prompt_kind: str = "random"         # "random" token ids, or "text" cut from the chat dataset
    num_system_prompts: int = 0         # >0: each session starts with one of these shared system prompts
    system_len: int = 0
    priority_classes: list[int] = field(default_factory=lambda: [0])   # drawn per session
    priority_weights: list[float] = field(default_factory=lambda: [1.0])
    num_clients: int = 1                # each session belongs to one client
    client_rate_shares: list[float] | None = None
    ttft_slo_ms: list[float] | None = None  # per-request TTFT target, one per entry of priority_classes
    e2el_slo_ms: list[float] | None = None  # per-request end-to-end target, one per entry of priority_classes
    ignore_eos: bool = True             # so each reply really has its sampled length
    working_set_tokens: int | None = None   # set: sessions to hold about this many tokens, revisited at random
    tool_output_len: LengthDist | None = None   # set: each later turn appends a tool output this long
    seed: int = 0

    def __post_init__(self) -> None:
        validate_workload_config(self)

    def expected_session_tokens(self) -> float:
        """Mean tokens of one whole session's last prompt: the system prompt, every user message and tool
        output, every reply but the last."""
        turns = float(self.turns.mean)
        tool = float(self.tool_output_len.mean) if self.tool_output_len is not None else 0.0
        return (self.system_len + turns * float(self.user_len.mean) + (turns - 1) * (float(self.reply_len.mean) + tool))


@dataclass
class TraceWorkloadConfig:
    """Replay a ``.jsonl`` trace (own arrival times), a Mooncake trace (``.jsonl``, arrivals in ms, prompts
    synthesised from block hash ids), a ShareGPT ``.json`` file (arrivals from ``request_rate``) or a CSV trace
    of arrivals and token counts: Azure's LLM inference traces, Vidur's processed traces, BurstGPT
    (``nanovllm.harness.workload.csv_traces``; arrivals relative to the first request, random prompts).

    ``format``: ``auto`` (``.json`` is ShareGPT; a ``.jsonl`` whose first line has Mooncake's ``timestamp``,
    ``input_length`` or ``hash_ids`` is Mooncake, else nano-vllm's JSONL; a ``.csv`` by its header's columns), or
    ``jsonl`` / ``mooncake`` / ``sharegpt`` / ``azure`` / ``vidur`` / ``burstgpt`` whatever the file is called.
    ``zero_tokens``: CSV rows with 0 prompt or output tokens (BurstGPT's failed requests) are left out
    (``skip``), replayed with one token (``one``) or an error. ``models`` / ``log_types``: BurstGPT only, keep the
    rows of these ``Model`` / ``Log Type`` values (null: all). ``time_scale`` multiplies arrival times (0.5 replays twice as fast;
    0 sends everything at t=0). ``max_requests`` keeps the first N requests of the file. ``block_size``: tokens
    per Mooncake hash id (512 in Mooncake's traces). ``seed`` drives ShareGPT arrivals, the random tokens of
    ``prompt_len`` lines and the tokens of each Mooncake block.
    """

    name: str = "trace"
    path: str = ""
    format: str = "auto"                # auto | jsonl | mooncake | sharegpt | azure | vidur | burstgpt
    time_scale: float = 1.0
    max_requests: int | None = None
    default_output_len: int = 128       # for JSONL lines without output_len (Mooncake: output_length)
    block_size: int = 512               # Mooncake only: tokens per hash id
    request_rate: float = float("inf")  # ShareGPT only: it has no timestamps
    burstiness: float = 1.0
    ignore_eos: bool = True             # replay the trace's output lengths exactly
    zero_tokens: str = "skip"           # CSV traces: rows with 0 prompt or output tokens: skip | one | error
    models: list[str] | None = None     # BurstGPT only: keep these Model values (ChatGPT, GPT-4); null: all
    log_types: list[str] | None = None  # BurstGPT only: keep these Log Type values (Conversation log, API log)
    seed: int = 0

    def __post_init__(self) -> None:
        # The file may not exist yet when the config object is built; generate_workload checks it.
        validate_workload_config(self, check_files=False)
