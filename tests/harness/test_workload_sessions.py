"""The multi_turn workload: each turn's prompt is the conversation so far, turns grouped by session_id, open-loop
arrivals, seeds, one-line errors naming the field, and prefix-cache hits on later turns through runner=sim."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from helpers import REPO
from nanovllm.harness.workload import LengthDist, MultiTurnWorkloadConfig, generate_workload, validate_workload_config

# Small sessions of varied length: 2-6 turns, a shared system prompt out of two, varied messages and replies.
CFG = MultiTurnWorkloadConfig(
    num_sessions=12, request_rate=3.0, turns=LengthDist(kind="uniform", mean=4, range_ratio=0.5, max=16),
    user_len=LengthDist(kind="uniform", mean=10, range_ratio=0.5), reply_len=LengthDist(kind="uniform", mean=6,
                                                                                        range_ratio=0.5),
    num_system_prompts=2, system_len=16, think_time_s=1.5, reply_time_per_token_s=0.01, seed=3)


def _sessions(requests) -> dict[str, list]:
    """The requests of each session, in turn order (their ids say the turn)."""
    by_session: dict[str, list] = defaultdict(list)
    for r in requests:
        by_session[r.session_id].append(r)
    return {s: sorted(rs, key=lambda r: int(r.request_id.rsplit("turn", 1)[1])) for s, rs in by_session.items()}


def test_every_turn_starts_with_the_previous_turns_prompt(tokenizer):
    sessions = _sessions(generate_workload(CFG, tokenizer))
    for turns in sessions.values():
        for previous, turn in zip(turns, turns[1:]):
            # The previous prompt, its synthesised reply (of the length it asked for), then the new message.
            assert turn.prompt[:len(previous.prompt)] == previous.prompt
            assert len(turn.prompt) >= len(previous.prompt) + previous.max_tokens + CFG.user_len.min
    firsts = [turns[0].prompt[:CFG.system_len] for turns in sessions.values()]
    assert len({tuple(p) for p in firsts}) == 2  # the two shared system prompts, each used by several sessions


def test_prompt_lengths_add_up_turn_by_turn(tokenizer):
    cfg = replace(CFG, user_len=LengthDist(mean=7), reply_len=LengthDist(mean=5), turns=LengthDist(mean=3))
    for turns in _sessions(generate_workload(cfg, tokenizer)).values():
        # system + (k+1) user messages + k replies
        assert [len(r.prompt) for r in turns] == [16 + 7, 16 + 7 + 5 + 7, 16 + 2 * (7 + 5) + 7]
        assert all(r.max_tokens == 5 and r.ignore_eos for r in turns)


def test_session_ids_group_turns_and_counts_match_the_config(tokenizer):
    requests = generate_workload(CFG, tokenizer)
    sessions = _sessions(requests)
    assert sorted(sessions) == sorted(f"session{i}" for i in range(CFG.num_sessions))
    assert len({r.request_id for r in requests}) == len(requests)  # unique ids: the engine finds requests by them
    for session, turns in sessions.items():
        assert [r.request_id for r in turns] == [f"{session}-turn{k}" for k in range(len(turns))]
        assert 2 <= len(turns) <= 6
        assert len({r.client_id for r in turns}) == 1 and len({r.priority for r in turns}) == 1
    fixed = generate_workload(replace(CFG, turns=LengthDist(mean=5)), tokenizer)
    assert len(fixed) == CFG.num_sessions * 5


def test_arrivals_increase_within_a_session_by_the_reply_time_and_the_think_time(tokenizer):
    requests = generate_workload(CFG, tokenizer)
    assert [r.arrival_time for r in requests] == sorted(r.arrival_time for r in requests)
    for turns in _sessions(requests).values():
        for previous, turn in zip(turns, turns[1:]):
            assert turn.arrival_time > previous.arrival_time + previous.max_tokens * CFG.reply_time_per_token_s
    # Without think time the gap is exactly the reply's assumed time.
    no_think = generate_workload(replace(CFG, think_time_s=0.0), tokenizer)
    for turns in _sessions(no_think).values():
        for previous, turn in zip(turns, turns[1:]):
            assert math.isclose(turn.arrival_time - previous.arrival_time, previous.max_tokens * 0.01)


def test_sessions_start_at_request_rate_over_mean_turns(tokenizer):
    cfg = MultiTurnWorkloadConfig(num_sessions=3000, request_rate=8.0, turns=LengthDist(mean=4), seed=1,
                                  user_len=LengthDist(mean=1), reply_len=LengthDist(mean=1))
    starts = np.array([r.arrival_time for r in generate_workload(cfg, tokenizer) if r.request_id.endswith("-turn0")])
    assert np.mean(np.diff(np.sort(starts))) == pytest.approx(4 / 8.0, rel=0.05)  # 2 sessions/s = 8 requests/s
    at_once = generate_workload(replace(cfg, num_sessions=5, request_rate=float("inf")), tokenizer)
    assert [r.arrival_time for r in at_once if r.request_id.endswith("-turn0")] == [0.0] * 5


def test_same_seed_same_sessions_and_text_prompts(tokenizer):
    assert generate_workload(CFG, tokenizer) == generate_workload(CFG, tokenizer)
    assert [r.prompt for r in generate_workload(replace(CFG, seed=4), tokenizer)] != \
        [r.prompt for r in generate_workload(CFG, tokenizer)]
    text = generate_workload(replace(CFG, prompt_kind="text", num_sessions=2), tokenizer)
    for turns in _sessions(text).values():
        for previous, turn in zip(turns, turns[1:]):
            assert turn.prompt[:len(previous.prompt)] == previous.prompt
    assert " " in tokenizer.decode(text[0].prompt)  # readable words, not random ids


@pytest.mark.parametrize("kw,field", [
    (dict(num_sessions=0), "num_sessions"),
    (dict(request_rate=0.0), "request_rate"),
    (dict(turns=LengthDist(min=0, mean=2)), "turns.min"),
    (dict(user_len=LengthDist(kind="normal")), "user_len.kind"),
    (dict(reply_len=LengthDist(mean=0.5)), "reply_len.mean"),
    (dict(think_time_s=-1.0), "think_time_s"),
    (dict(reply_time_per_token_s=float("inf")), "reply_time_per_token_s"),
    (dict(system_len=8), "num_system_prompts"),
    (dict(num_system_prompts=2), "system_len"),
    (dict(prompt_kind="words"), "prompt_kind"),
    (dict(num_clients=2, client_rate_shares=[1.0]), "client_rate_shares"),
])
def test_invalid_multi_turn_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"^workload\.{field}=.* is invalid: must") as e:
        MultiTurnWorkloadConfig(**kw)
    assert "\n" not in str(e.value)


# -- through Hydra and the simulator ------------------------------------------------------------------------------

def _compose(*overrides: str):
    """The run's config from this checkout's conf/ (what config_dir() is in a checkout, test_run.py checks)."""
    from nanovllm.harness.conf_schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_the_config_file_composes_and_its_overrides_are_checked(tokenizer):
    cfg = _compose("workload=multi_turn", "seed=5")
    assert cfg.workload.name == "multi_turn" and cfg.workload.seed == 5 and cfg.workload.system_len > 0
    requests = generate_workload(cfg.workload, tokenizer)
    assert len({r.session_id for r in requests}) == cfg.workload.num_sessions
    with pytest.raises(ConfigCompositionException):
        _compose("workload=multi_turn", "workload.num_session=3")  # misspelt: the schema refuses it
    bad = _compose("workload=multi_turn", "workload.think_time_s=-2")
    with pytest.raises(ValueError, match=r"workload\.think_time_s=-2"):
        validate_workload_config(bad.workload)
    assert OmegaConf.to_container(cfg.workload.turns)["kind"] == "uniform"


def test_later_turns_hit_the_prefix_cache_in_a_simulated_run():
    """python -m nanovllm.run runner=sim workload=multi_turn allocator=prefix, in-process: the steps of
    nanovllm.harness.run.run without Hydra's run directory."""
    from nanovllm.harness.run import check_config
    from nanovllm.harness.runners import served_engine

    cfg = _compose("runner=sim", "workload=multi_turn", "allocator=prefix", "engine.num_kv_blocks=256",
                   "workload.num_sessions=6", "workload.system_len=48", "workload.request_rate=4")
    checked = check_config(cfg)
    served = served_engine(checked.runner, checked.hardware, checked.engine, scheduler=checked.scheduler,
                           allocator=checked.allocator, attention=checked.attention)
    result = served.serve(generate_workload(cfg.workload, served.engine.tokenizer))
    records = result.requests
    assert all(r["error"] is None for r in records) and {r["session_id"] for r in records} == \
        {f"session{i}" for i in range(6)}
    later = [r for r in records if not r["request_id"].endswith("-turn0")]
    assert later and all(r["num_cached_tokens"] > 0 for r in later)
    # Each later turn finds at least the full blocks of the previous turn's prompt (16-token blocks).
    prompt_len = {r["request_id"]: r["num_prompt_tokens"] for r in records}
    for r in later:
        session, turn = r["request_id"].rsplit("-turn", 1)
        assert r["num_cached_tokens"] >= prompt_len[f"{session}-turn{int(turn) - 1}"] // 16 * 16
