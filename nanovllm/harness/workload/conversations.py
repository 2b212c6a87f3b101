"""Multi-turn conversations: sessions whose every turn re-sends the whole conversation so far.

Turn k of a session sends ``system prompt + user_0 + reply_0 + ... + user_{k-1} + reply_{k-1} + user_k`` as
token ids, so its prompt starts with turn k-1's whole prompt: a prefix cache, and a router that sends a session
where its prefix is cached, see the reuse a chat service sees. Every turn carries its session's ``session_id``
(``"session3"``) and an id of its own (``"session3-turn1"``).

The workload is open loop: every arrival is fixed before the run starts. The generator cannot know the reply the
engine will give, so the assistant reply inside the next prompt is synthesised: ``reply_len`` tokens of the same
kind as the user messages, the very length the turn asks for (``max_tokens``, with ``ignore_eos``). Closed-loop
clients do otherwise -- vLLM's multi-turn benchmark (``benchmarks/multi_turn``) and SGLang's
``bench_multiturn.py`` wait for each answer and send the real reply in the next turn, so the next prompt also
reuses the reply's KV. Here the prefix a turn shares with the previous one is the previous *prompt*; the reply
is the same length but not the same tokens, so the cached blocks a turn can hit stop where the previous reply
starts. Sending the real reply would need the serving loop to build a turn when the previous one finishes (a
closed loop); that is not built.

With ``working_set_tokens`` the session count follows from it (``expected_session_tokens`` each) and the
turns arrive as one process at ``request_rate``, each going to a random session with turns left (its turns in
order): a fixed set of conversations revisited, so the working set does not change with the rate. With
``tool_output_len`` (agentic sessions) every turn after the first appends a tool output before its message.

For the same reason the next turn's arrival is a model, not a measurement: turn k+1 arrives
``reply_len_k * reply_time_per_token_s`` (the time the reply is assumed to take) plus an exponential think
time of mean ``think_time_s`` after turn k. A server slower than assumed sees the next turn before the previous
reply is done, as an open-loop load generator would send it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nanovllm.harness.workload.config import WorkloadRequest
from nanovllm.harness.workload.distributions import (
    _rng,
    _sample_clients,
    _sample_priorities,
    _slo_targets,
    sample_arrival_times,
    sample_lengths,
)
from nanovllm.harness.workload.prompts import _shared_prefixes, _token_maker


def _turn_gaps(cfg: Any, reply_lens: np.ndarray) -> np.ndarray:
    """Seconds from each turn's arrival to the next one of its session: its reply's assumed time + think time."""
    think = _rng(cfg.seed, "think_time").exponential(cfg.think_time_s, size=len(reply_lens)) \
        if cfg.think_time_s > 0 else np.zeros(len(reply_lens))
    return reply_lens * float(cfg.reply_time_per_token_s) + think


def multi_turn_requests(cfg: Any, tokenizer: Any) -> list[WorkloadRequest]:
    """Every turn of every session of a ``multi_turn`` config, session by session, turns in order."""
    working_set = getattr(cfg, "working_set_tokens", None)
    n = cfg.num_sessions if working_set is None else max(1, round(working_set / cfg.expected_session_tokens()))
    turns = sample_lengths(cfg.turns, n, _rng(cfg.seed, "turns"))
    total = int(turns.sum())
    # One draw per turn, session by session: turn j of the flattened list is turn k of session s.
    user_lens = sample_lengths(cfg.user_len, total, _rng(cfg.seed, "input_len"))
    reply_lens = sample_lengths(cfg.reply_len, total, _rng(cfg.seed, "output_len"))
    tool = getattr(cfg, "tool_output_len", None)
    tool_lens = (sample_lengths(tool, total, _rng(cfg.seed, "tool_output_len")) if tool is not None
                 else np.zeros(total, dtype=int))
    gaps = _turn_gaps(cfg, reply_lens)
    revisits = _revisit_times(cfg, turns) if working_set is not None else None
    # request_rate counts requests: sessions start turns.mean times less often, so the long-run request rate is
    # request_rate whatever the number of turns (inf / anything is inf: every session at t=0).
    starts = sample_arrival_times(n, cfg.request_rate / float(cfg.turns.mean), cfg.burstiness,
                                  _rng(cfg.seed, "arrivals"))
    make = _token_maker(cfg.prompt_kind, tokenizer)
    systems = (_shared_prefixes(make, cfg.seed, cfg.num_system_prompts, cfg.system_len, n)
               if cfg.num_system_prompts > 0 else [[] for _ in range(n)])
    priorities = _sample_priorities(cfg, n, _rng(cfg.seed, "priority"))
    clients = _sample_clients(cfg, n, _rng(cfg.seed, "client"))
    rng = _rng(cfg.seed, "prompts")
    out: list[WorkloadRequest] = []
    j = 0
    for s in range(n):
        session = f"session{s}"
        history: list[int] = list(systems[s])
        arrival = float(starts[s])
        for k in range(int(turns[s])):
            if revisits is not None:
                arrival = revisits[s][k]
            elif k > 0:
                arrival += float(gaps[j - 1])
            # An agent's later turns carry the tool's output (drawn as prompt tokens) before the next message.
            tool_output = make(int(tool_lens[j]), rng) if k > 0 and tool_lens[j] > 0 else []
            prompt = history + tool_output + make(int(user_lens[j]), rng)
            out.append(WorkloadRequest(
                arrival_time=arrival, prompt=prompt, max_tokens=int(reply_lens[j]), priority=priorities[s],
                client_id=clients[s], ignore_eos=bool(cfg.ignore_eos), request_id=f"{session}-turn{k}",
                session_id=session, **_slo_targets(cfg, priorities[s])))
            if k + 1 < turns[s]:  # the last reply is never re-sent: no tokens drawn for it
                history = prompt + make(int(reply_lens[j]), rng)
            j += 1
    if revisits is not None:
        out.sort(key=lambda request: request.arrival_time)
    return out


def _revisit_times(cfg: Any, turns: np.ndarray) -> list[list[float]]:
    """``working_set_tokens``: per session, its turns' arrival times, when turns arrive at ``request_rate`` (one
    gamma process, ``burstiness``) and each goes to a random session with turns left."""
    times = sample_arrival_times(int(turns.sum()), cfg.request_rate, cfg.burstiness, _rng(cfg.seed, "arrivals"))
    rng = _rng(cfg.seed, "revisits")
    left = [int(t) for t in turns]
    owners = [s for s, count in enumerate(left) for _ in range(count)]
    rng.shuffle(owners)   # a random interleaving of every session's turns, each session's in order
    per_session: list[list[float]] = [[] for _ in left]
    for t, s in zip(times, owners):
        per_session[s].append(float(t))
    return per_session
