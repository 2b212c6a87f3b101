"""The live views: the tolerant tail reader, what the dashboard computes from a run's files (and at a scrubbed
moment), the terminal view, the ``live`` config group, clear errors (bad RUN_DIR, port in use, a failing live
logger), and a real run with ``live=web`` watched in headless Chromium as a person would."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from helpers import REPO, request_record
from nanovllm.harness.live.config import LiveConfig
from nanovllm.harness.live.feed import (
    EngineSizes,
    NotARunError,
    RunFeed,
    SpecTotals,
    TierTotals,
    block_map,
    check_run_dir,
    gantt_rows,
    has_tiers,
    latency_table,
    spec_columns,
    speculating,
    step_columns,
    tier_columns,
)
from nanovllm.harness.live.launch import LiveSession, NeverFails, _start_dashboard, free_port
from nanovllm.harness.live.tui import TuiView, sparkline
from nanovllm.serving.loggers import RunLogger
from nanovllm.serving.records import JsonlTail, RunWriter



# -- a run's files, written through the real writer ----------------------------------------------------------------

def _step(i: int, running: int, waiting: int, used: int, preempted: int = 0, prefill: int = 0) -> dict:
    return dict(step=i, start_time=0.1 * i, duration=0.1, num_prefill_tokens=prefill, num_decode_tokens=running,
                num_prefill_seqs=int(prefill > 0), num_decode_seqs=running, num_running=running,
                num_waiting=waiting, num_preempted=preempted, kv_blocks_used=used, kv_blocks_cached=0,
                kv_blocks_free=8 - used, kv_blocks_total=8, context_tokens=0, attn_pairs=0, num_sampled=running)


def _snapshot(step: int, time_: float, *requests: tuple[str, str, list[int]]) -> dict:
    return {"step": step, "time": time_, "requests": [
        dict(request_id=rid, status=status, priority=0, client_id=None, arrival_time=0.0, first_scheduled_time=0.1,
             first_token_time=None, num_prompt_tokens=10, num_computed_tokens=5, num_output_tokens=0,
             num_preemptions=0, blocks=blocks) for rid, status, blocks in requests]}


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    """Ten steps, two requests (one preempted between 0.4 s and 0.6 s), snapshots with a shared block."""
    writer = RunWriter(tmp_path / "run", {"engine": {"max_num_seqs": 4}, "workload": {"num_requests": 3}})
    extras = RunWriter.for_extras(tmp_path / "run")
    extras.write_engine_info(dict(num_kv_blocks=8, bytes_per_block=2**20, max_num_seqs=4,
                                  max_num_batched_tokens=64, num_requests=3))
    for i in range(10):
        writer.write_step(_step(i, running=2 if i < 8 else 1, waiting=1, used=4, preempted=int(i == 3),
                                prefill=20 if i == 0 else 0))
    writer.write_request(request_record("a", 0.0, token_times=(0.2, 0.55), priority=0))
    writer.write_request(request_record("b", 0.0, token_times=(0.2, 0.95), priority=1, num_preemptions=1))
    extras.write_blocks(_snapshot(2, 0.3, ("a", "running", [0, 1]), ("b", "running", [1, 2])))
    extras.write_blocks(_snapshot(4, 0.5, ("a", "running", [0, 1]), ("b", "preempted", []),
                                  ("c", "waiting", [])))
    extras.write_blocks(_snapshot(6, 0.7, ("b", "running", [3, 4]), ("c", "waiting", [])))
    writer.close()
    extras.close()
    return tmp_path / "run"


# -- the tail reader -----------------------------------------------------------------------------------------------

def test_tail_holds_back_a_torn_line_until_it_is_complete(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    tail = JsonlTail(path)
    assert tail.read_new() == [] and not tail.torn  # not there yet: empty, no error
    path.write_text('{"step": 0}\n{"step": 1}\n{"ste')
    assert tail.read_new() == [{"step": 0}, {"step": 1}] and tail.torn
    with open(path, "a") as f:
        f.write('p": 2}\nnot json\n')
    assert tail.read_new() == [{"step": 2}] and not tail.torn and tail.bad_lines == 1
    assert tail.read_new() == []
    path.write_text('{"step": 9}\n')  # rewritten by a new run: read again from the start
    assert tail.read_new() == [{"step": 9}]


# -- what the dashboard computes -----------------------------------------------------------------------------------

def test_feed_columns_gantt_and_block_map(run_dir: Path) -> None:
    feed = RunFeed(run_dir)
    steps, requests, snapshots = feed.poll()
    assert (len(steps), len(requests), len(snapshots)) == (10, 2, 3)
    assert feed.sizes.num_kv_blocks == 8 and feed.sizes.max_num_seqs == 4
    columns = step_columns(feed.steps, feed.sizes)
    assert columns["running"][0] == 2 and columns["kv_used_mib"][0] == 4.0 and columns["max_num_seqs"][0] == 4
    assert columns["throughput"][5] == pytest.approx(2 / 0.1 * 5 / 5, rel=0.3)  # two tokens a 0.1 s step
    assert feed.preempted == {"b": [[0.5, 0.7]]}

    # At 0.6 s: a has ended (finished), b is in flight (from its record cut at t) and was preempted at 0.5 s.
    gantt = gantt_rows(feed, 0.6)
    phases = {(rid, phase) for rid, phase in zip(gantt["request_id"], gantt["phase"])}
    assert {("a", "finished"), ("a", "decoding"), ("b", "preempted"), ("c", "queued")} <= phases
    assert ("b", "finished") not in phases
    assert max(e for e, phase in zip(gantt["end"], gantt["phase"]) if phase != "finished") <= 0.6
    assert gantt["row"][0].startswith("p0")  # rows grouped by priority

    blocks = block_map(feed.snapshot_at(0.35), 8)
    assert blocks["state"][:4] == ["owned", "shared", "owned", "free"] and blocks["owners"][1] == "a, b"
    assert block_map(feed.snapshot_at(0.1), 8)["state"] == ["free"] * 8  # before the first snapshot

    table = latency_table(feed.requests_ended_by(0.6))
    assert table["group"] == ["all"] and table["done"] == [1]
    table = latency_table(feed.requests)
    assert table["group"] == ["all", "priority 0", "priority 1"] and table["p50_ttft_ms"][0] == pytest.approx(200)


def test_dashboard_scrubs_back_and_follows_again(run_dir: Path) -> None:
    from nanovllm.harness.live.web import RunDashboard

    view = RunDashboard(run_dir)
    view.layout()
    view.update()
    assert len(view.steps_src.data["t"]) == 10 and "nv-step'>9<" in view.header.text
    assert "nv-finished'>2</span> / 3" in view.header.text and "run <span class='nv-state'>running" in view.header.text
    view._on_scrub("value_throttled", 1.0, 0.45)
    assert not view.following and len(view.steps_src.data["t"]) == 4
    assert view.latency_src.data["done"] == [] and "showing t = 0.45" in view.header.text
    assert all(span.visible and span.location == 0.45 for span in view.cursors)
    view._on_follow()
    assert view.following and len(view.steps_src.data["t"]) == 10 and view.latency_src.data["done"][0] == 2

    with open(run_dir / "steps.jsonl", "a") as f:  # the run goes on, its writer caught mid-line
        f.write(json.dumps(_step(10, 1, 0, 2)) + "\n" + '{"step": 11, "sta')
    view.update()
    assert len(view.steps_src.data["t"]) == 11 and view.notice.text == ""  # torn line while running: silent
    (run_dir / "metrics.json").write_text("{}")
    view.update()
    assert "nv-state'>finished" in view.header.text and "steps.jsonl end with an incomplete line" in view.notice.text


# -- speculative decoding's charts ---------------------------------------------------------------------------------

def _spec_step(i: int, drafts: int, proposed: int, per_pos: list[int]) -> dict:
    """A decode step of two requests that verified ``drafts`` proposals of ``proposed`` tokens in all,
    ``per_pos[i]`` of them accepted at position i (accepted runs are prefixes, so the counts never grow)."""
    return {**_step(i, running=2, waiting=0, used=4), "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": proposed, "spec_decode_num_accepted_tokens": sum(per_pos),
            "spec_decode_num_accepted_tokens_per_pos": per_pos}


def _spec_run(tmp_path: Path, steps: list[dict], k: int | None) -> Path:
    writer = RunWriter(tmp_path / "run", {"engine": {"max_num_seqs": 4}, "workload": {"num_requests": 2},
                                          "speculative": {"method": "ngram" if k else None, "num_tokens": k}})
    for step in steps:
        writer.write_step(step)
    writer.close()
    return tmp_path / "run"


def test_spec_columns_roll_acceptance_over_the_window() -> None:
    # 0.1 s steps: steps 0-4 accept everything (2 drafts of 3 tokens each), steps 5-9 accept nothing.
    steps = [_spec_step(i, 2, 6, [2, 2, 2]) for i in range(5)] + [_spec_step(i, 2, 6, []) for i in range(5, 10)]
    columns = spec_columns(steps, window=0.15)   # a row: the steps that ended in the last 0.15 s (two)
    assert columns["proposed"] == [6] * 10 and columns["accepted"] == [6] * 5 + [0] * 5
    assert columns["acceptance_rate"][:5] == [1.0] * 5 and columns["mean_accepted_length"][0] == 4.0
    assert columns["acceptance_rate"][5] == pytest.approx(0.5)   # steps 4 and 5: 6 of 12
    assert columns["acceptance_rate"][6:] == [0.0] * 4 and columns["mean_accepted_length"][9] == 1.0
    # The same rows computed in two pieces, the first piece as history, as the dashboard streams them.
    later = spec_columns(steps[6:], history=steps[:6], window=0.15)
    assert later == {name: values[6:] for name, values in columns.items()}
    # A window in which nothing was proposed is a gap (NaN), not a zero acceptance.
    idle = spec_columns([_spec_step(0, 0, 0, []), _step(1, running=1, waiting=0, used=1)], window=0.05)
    assert all(math.isnan(v) for v in idle["acceptance_rate"] + idle["mean_accepted_length"])


def test_spec_totals_per_position_and_when_the_charts_show() -> None:
    totals = SpecTotals()
    totals.add([_spec_step(0, 2, 6, [2, 1]), _spec_step(1, 2, 6, [1]), _step(2, running=1, waiting=0, used=1)])
    assert (totals.drafts, totals.proposed, totals.accepted) == (4, 12, 4)
    assert totals.positions(3) == {"position": [1, 2, 3], "accepted": [3, 1, 0], "drafts": [4, 4, 4],
                                   "rate": [0.75, 0.25, 0.0]}
    assert totals.positions()["position"] == [1, 2]   # K unknown: the positions seen so far
    assert SpecTotals().positions(2)["rate"] == [0.0, 0.0]
    assert speculating([], EngineSizes(num_speculative_tokens=3))
    assert speculating([_spec_step(0, 1, 3, [])], EngineSizes())   # proposals, even if none accepted
    assert not speculating([_spec_step(0, 0, 0, []), _step(1, 1, 0, 1)], EngineSizes())


def test_spec_sizes_come_from_the_run_config(tmp_path: Path) -> None:
    assert EngineSizes.read(_spec_run(tmp_path / "on", [], k=4)).num_speculative_tokens == 4
    assert EngineSizes.read(_spec_run(tmp_path / "off", [], k=None)).num_speculative_tokens is None


def test_dashboard_shows_speculation_only_when_on_and_keeps_a_bounded_window(tmp_path: Path, monkeypatch) -> None:
    from nanovllm.harness.live import web

    off = web.RunDashboard(_spec_run(tmp_path / "off", [_spec_step(i, 0, 0, []) for i in range(5)], k=None))
    off.layout()
    off.update()
    assert not off.spec_section.visible and off.spec_src.data["t"] == []

    monkeypatch.setattr(web, "SPEC_ROLLOVER", 8)
    steps = [_spec_step(i, 2, 6, [2, 1]) for i in range(12)]
    run = _spec_run(tmp_path / "on", steps[:10], k=3)
    view = web.RunDashboard(run)
    view.layout()
    view.update()
    assert view.spec_section.visible
    assert view.spec_src.data["step"] == list(range(2, 10))   # the latest 8 of 10 steps
    assert view.position_src.data["rate"] == [1.0, 0.5, 0.0]   # over all 10 steps, whatever the window kept
    assert "nv-proposed'>60<" in view.spec_header.text and "nv-acceptance'>0.50<" in view.spec_header.text
    assert "nv-accepted-length'>2.50<" in view.spec_header.text and "(K = 3)" in view.spec_header.text
    with open(run / "steps.jsonl", "a") as f:   # the run goes on: two more steps stream in, two scroll out
        f.writelines(json.dumps(s) + "\n" for s in steps[10:])
    view.update()
    assert view.spec_src.data["step"] == list(range(4, 12)) and "nv-proposed'>72<" in view.spec_header.text
    view._on_scrub("value_throttled", 1.2, 0.45)   # back to t = 0.45: steps 0-3
    assert view.spec_src.data["step"] == [0, 1, 2, 3] and view.position_src.data["accepted"] == [8, 4, 0]
    view._on_follow()
    assert view.spec_src.data["step"][-1] == 11 and view.position_src.data["accepted"] == [24, 12, 0]

    # A replayed run with no config: the rows appear with the first step that proposed something.
    quiet = [_spec_step(i, 0, 0, []) for i in range(3)]
    bare = tmp_path / "bare" / "run"
    bare.mkdir(parents=True)
    (bare / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in quiet))
    view = web.RunDashboard(bare)
    view.layout()
    view.update()
    assert not view.spec_section.visible
    with open(bare / "steps.jsonl", "a") as f:
        f.write(json.dumps(_spec_step(3, 1, 3, [1])) + "\n")
    view.update()
    assert view.spec_section.visible and view.spec_src.data["step"] == [0, 1, 2, 3]   # earlier steps drawn too


# -- KV tiers' charts ----------------------------------------------------------------------------------------------

MIB = 2**20


def _tier_step(i: int, held: int, loaded: int = 0, written: int = 0, hits: int = 0, prefill: int = 0,
               name: str = "host", replica: int | None = None) -> dict:
    """A step whose tier ``name`` holds ``held`` blocks of 1 MiB after it, having loaded ``loaded`` (serving
    ``hits`` prompt tokens of the ``prefill + hits`` it admitted) and written ``written`` blocks in it."""
    counts = dict(hit_tokens=hits, blocks_written=written, blocks_loaded=loaded, bytes_written=written * MIB,
                  bytes_loaded=loaded * MIB, failures=0, load_seconds=0.001 * loaded, blocks=held, bytes=held * MIB)
    step = {**_step(i, running=1, waiting=0, used=2, prefill=prefill), "prefix_hit_tokens": hits,
            "swapped_tokens": 0, "kv_tiers": {name: counts}}
    return step if replica is None else {**step, "replica": replica}


def _tier_run(tmp_path: Path, steps: list[dict], kv_offload: object, replicas: int = 1) -> Path:
    writer = RunWriter(tmp_path / "run", {"engine": {"max_num_seqs": 4}, "workload": {"num_requests": 2},
                                          "kv_offload": kv_offload, "cluster": {"replicas": replicas}})
    for step in steps:
        writer.write_step(step)
    writer.close()
    return tmp_path / "run"


def test_tier_columns_hold_each_tiers_occupancy_and_moves_per_step() -> None:
    steps = [_tier_step(0, held=2, written=2, prefill=32), _tier_step(1, held=2, loaded=1, hits=16, prefill=16),
             _tier_step(2, held=3, written=1)]
    columns = tier_columns(steps, EngineSizes(kv_tiers={"host": 4 * MIB}))
    host = columns["host"]
    assert list(columns) == ["host"] and host["step"] == [0, 1, 2] and host["t"] == pytest.approx([0.1, 0.2, 0.3])
    assert host["blocks"] == [2, 2, 3] and host["mib"] == [2.0, 2.0, 3.0] and host["fraction"] == [0.5, 0.5, 0.75]
    assert host["blocks_loaded"] == [0, 1, 0] and host["mib_loaded"] == [0.0, 1.0, 0.0]
    assert host["blocks_written"] == [2, 0, 1] and host["mib_written"] == [2.0, 0.0, 1.0]
    assert host["hit_tokens"] == [0, 16, 0]
    unknown = tier_columns(steps, EngineSizes())["host"]["fraction"]   # no capacity stated: a gap, not a 0
    assert all(math.isnan(f) for f in unknown)
    assert tier_columns([_step(0, 1, 0, 1)], EngineSizes()) == {}   # steps without tiers: no rows
    # A cluster: replicas interleave; a tier holds every replica's latest together, the shared store the largest.
    cluster = [_tier_step(0, held=2, replica=0), _tier_step(1, held=5, replica=1), _tier_step(2, held=3, replica=0),
               _tier_step(3, held=4, name="shared", replica=0), _tier_step(4, held=6, name="shared", replica=1)]
    later = tier_columns(cluster[2:], EngineSizes(), history=cluster[:2])
    assert later["host"]["blocks"] == [8] and later["shared"]["blocks"] == [4, 6]


def test_tier_totals_sum_the_moves_and_keep_the_latest_holdings() -> None:
    totals = TierTotals()
    assert totals.counts == {} and totals.figures("host")["hit_rate"] is None
    totals.add([_tier_step(0, held=2, written=2, prefill=32), _step(1, 1, 0, 1),
                _tier_step(2, held=1, loaded=1, hits=16, prefill=16)])
    figures = totals.figures("host", capacity=4 * MIB)
    assert figures == {"blocks": 1, "mib": 1.0, "fraction": 0.25, "hit_tokens": 16, "hit_rate": 0.25,
                       "blocks_loaded": 1, "mib_loaded": 1.0, "blocks_written": 2, "mib_written": 2.0,
                       "load_seconds": 0.001}
    assert totals.figures("host")["fraction"] is None   # no capacity: no fraction
    assert has_tiers([], EngineSizes(kv_tiers={"host": MIB}))
    assert has_tiers([_step(0, 1, 0, 1), _tier_step(1, held=0)], EngineSizes())   # a step carried tier counters
    assert not has_tiers([_step(0, 1, 0, 1)], EngineSizes())


def test_tier_sizes_come_from_the_run_config(tmp_path: Path) -> None:
    stack = {"name": "host", "capacity": 4 * MIB, "policy": "evict", "below": {"name": "disk", "capacity": 64 * MIB}}
    assert EngineSizes.read(_tier_run(tmp_path / "on", [], stack)).kv_tiers == {"host": 4 * MIB, "disk": 64 * MIB}
    assert EngineSizes.read(_tier_run(tmp_path / "off", [], {"name": "none"})).kv_tiers is None
    # A cluster of 2: each replica's host tier counts (occupancy is summed), the shared store is one.
    shared = {"name": "host", "capacity": MIB, "below": {"name": "shared"}}
    assert EngineSizes.read(_tier_run(tmp_path / "two", [], shared, replicas=2)).kv_tiers == {"host": 2 * MIB,
                                                                                              "shared": None}
    # Two tiers of one kind go by their position, as their step records name them.
    from nanovllm.engine.kv_offload import tier_capacities
    assert tier_capacities({"name": "host", "capacity": 8, "below": {"name": "host", "capacity": 16}}) == {
        "host0": 8, "host1": 16}


def test_dashboard_shows_tiers_only_when_on_and_keeps_a_bounded_window(tmp_path: Path, monkeypatch) -> None:
    from bokeh.document import Document

    from nanovllm.harness.live import web

    def build(run: Path) -> web.RunDashboard:
        view = web.RunDashboard(run)
        Document().add_root(view.layout())   # the tab's document, as make_app builds it
        view.update()
        return view

    off = build(_spec_run(tmp_path / "off", [_step(i, 1, 0, 1) for i in range(5)], k=None))
    assert not off.tier_section.visible and off.tier_srcs == {} and off.tier_held.renderers == []

    monkeypatch.setattr(web, "TIER_ROLLOVER", 8)
    steps = [_tier_step(i, held=i, loaded=1, written=2, hits=16, prefill=16) for i in range(12)]
    run = _tier_run(tmp_path / "on", steps[:10], {"name": "host", "capacity": 16 * MIB})
    view = build(run)
    assert view.tier_section.visible and not view.spec_section.visible
    assert len(view.tier_held.renderers) == len(view.tier_moves.renderers) - 1 == 1   # one line a tier; two
    assert view.tier_held.renderers[0].glyph.y == "fraction"
    assert view.tier_srcs["host"].data["step"] == list(range(2, 10))   # the latest 8 of 10 steps
    assert view.tier_srcs["host"].data["fraction"][-1] == 9 / 16
    header = view.tier_header.text
    assert "nv-tier-loaded'>10.00<" in header and "nv-tier-hit'>0.50<" in header   # over all 10 steps
    assert "nv-tier-written'>20.00<" in header and "nv-tier-blocks'>9<" in header and "56.2% of 16.0 MiB" in header
    with open(run / "steps.jsonl", "a") as f:   # the run goes on: two more steps stream in, two scroll out
        f.writelines(json.dumps(s) + "\n" for s in steps[10:])
    view.update()
    assert view.tier_srcs["host"].data["step"] == list(range(4, 12))
    assert "nv-tier-loaded'>12.00<" in view.tier_header.text
    view._on_scrub("value_throttled", 1.2, 0.45)   # back to t = 0.45: steps 0-3
    assert view.tier_srcs["host"].data["step"] == [0, 1, 2, 3] and "nv-tier-loaded'>4.00<" in view.tier_header.text
    view._on_follow()
    assert view.tier_srcs["host"].data["step"][-1] == 11 and "nv-tier-loaded'>12.00<" in view.tier_header.text

    # A replayed run with no config: the row appears with the first step that carries tier counters (the
    # earlier ones carry none), drawn in MiB (no capacity known).
    bare = tmp_path / "bare" / "run"
    bare.mkdir(parents=True)
    (bare / "steps.jsonl").write_text("".join(json.dumps(_step(i, 1, 0, 1)) + "\n" for i in range(3)))
    view = build(bare)
    assert not view.tier_section.visible
    with open(bare / "steps.jsonl", "a") as f:
        f.write(json.dumps(_tier_step(3, held=2, written=2)) + "\n")
    view.update()
    assert view.tier_section.visible and view.tier_srcs["host"].data["mib"] == [2.0]
    assert view.tier_held.renderers[0].glyph.y == "mib" and view.tier_held.yaxis[0].axis_label == "MiB held"


def test_a_long_run_is_held_as_a_rolling_window_by_the_feed_and_the_dashboard(tmp_path: Path) -> None:
    """A server appends steps, requests and snapshots without end: the feed keeps the latest ``window`` of each
    (``snapshot_window`` snapshots), counts every one, drops preemption intervals older than its snapshots, and
    the dashboard's sources roll over at the window while following and scrubbing still show the latest steps."""
    from nanovllm.harness.live.web import RunDashboard

    writer = RunWriter(tmp_path / "run", {"engine": {"max_num_seqs": 4}, "workload": {"num_requests": 0}})
    extras = RunWriter.for_extras(tmp_path / "run")
    extras.write_engine_info(dict(num_kv_blocks=8, bytes_per_block=2**20, max_num_seqs=4,
                                  max_num_batched_tokens=64, num_requests=0))
    view = RunDashboard(tmp_path / "run")
    view.feed.window, view.feed.snapshot_window = 50, 5
    view.layout()
    step = 0
    for batch in range(8):   # 8 polls of 40 steps, 40 requests and 4 snapshots each
        for _ in range(40):
            writer.write_step(_step(step, running=2, waiting=0, used=4, preempted=int(step % 7 == 0)))
            writer.write_request(request_record(f"r{step}", 0.1 * step, token_times=(0.1 * step + 0.05,)))
            step += 1
        for k in range(4):
            t = 0.1 * (step - 40 + 10 * k)
            extras.write_blocks(_snapshot(step, t, (f"p{batch}", "preempted" if k < 2 else "running", [0])))
        view.update()
        feed = view.feed
        assert len(feed.steps) <= 50 and len(feed.requests) <= 50 and len(feed.snapshots) <= 5
        assert len(view.steps_src.data["t"]) <= 50 and len(view.preempt_src.data["t"]) <= 50
    assert feed.num_steps_seen == feed.num_requests_seen == 320
    assert [s["step"] for s in feed.steps] == list(range(270, 320))
    assert feed.steps_between(300, 305) == feed.steps[30:35] and feed.steps_between(0, 10) == []
    assert view.steps_src.data["step"][-1] == 319 and "nv-finished'>320<" in view.header.text
    assert set(feed.preempted) == {"p7"}   # p0-p6's intervals closed before the oldest snapshot kept
    view._on_scrub("value_throttled", 1.0, 30.05)
    assert view.steps_src.data["step"][-1] == 299 and view._shown_steps == 300
    view._on_follow()
    assert view.steps_src.data["step"][-1] == 319 and view._shown_steps == 320
    writer.close()
    extras.close()


def test_sweep_view_lists_jobs_and_their_cdfs(run_dir: Path, tmp_path: Path) -> None:
    from nanovllm.harness.live.web import SweepDashboard

    sweep = tmp_path / "sweep"
    for job in ("0", "1"):
        shutil.copytree(run_dir, sweep / job)
        (sweep / job / "metrics.json").write_text(json.dumps({"completed": 2, "median_ttft_ms": 200.0}))
    view = SweepDashboard(check_run_dir(sweep))
    view.layout()
    view.update()
    assert view.table_src.data["run"] == ["0", "1"] and view.table_src.data["completed"] == [2, 2]
    assert len(view.cdf_srcs["TTFT"].data["x"]) == 2 and "nv-jobs'>2<" in view.header.text


def test_bad_run_dirs_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(NotARunError, match="does not exist"):
        check_run_dir(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotARunError, match="is a file"):
        check_run_dir(tmp_path / "file")
    with pytest.raises(NotARunError, match="not a run directory"):
        check_run_dir(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "nanovllm.viz", "--live", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == f"error: {tmp_path / 'nope'} does not exist"


def test_port_in_use_is_a_clear_message_and_never_stops_the_run(run_dir: Path, capsys) -> None:
    from nanovllm.harness.live.web import PortInUseError, start_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert free_port("127.0.0.1", port) is None
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is in use"):
            start_server(run_dir, port=port)
        session = LiveSession(LiveConfig(mode="web", port=port), run_dir)
        _start_dashboard(session)
    assert session.process is None and f"port {port} on 127.0.0.1 is in use" in capsys.readouterr().err
    session.close(keep_open=True)  # nothing to close: returns at once


def test_a_failing_live_logger_is_switched_off_not_fatal(capsys) -> None:
    class Broken(RunLogger):
        calls = 0

        def log_step(self, step: dict) -> None:
            Broken.calls += 1
            raise OSError("disk full")

    logger = NeverFails(Broken())
    logger.log_step({})
    logger.log_step({})
    assert Broken.calls == 1 and logger.failed
    assert "Broken.log_step failed (OSError: disk full); live view off" in capsys.readouterr().err


def test_terminal_view_shows_the_essentials() -> None:
    view = TuiView(max_num_seqs=4, num_requests=3)
    for i in range(6):
        view.add_step(_step(i, running=min(i, 4), waiting=1, used=i, preempted=int(i == 2)))
    view.add_request(request_record("a", 0.0, token_times=(0.2, 0.5)))
    console = Console(record=True, width=100)
    console.print(view)
    text = console.export_text()
    assert "running 4  waiting 1  preempted 1 (total)  finished 1 / 3" in text
    assert "5 used, 0 cached, 3 free of 8" in text and "TTFT" in text and "p50 200" in text
    assert sparkline([0, 2, 4], 4) == "▁▅█"
    assert "KV tiers" not in text   # no tiers: no tier line

    tiered = TuiView(max_num_seqs=4, num_requests=3, tier_capacities={"host": 4 * MIB})
    tiered.add_step(_tier_step(0, held=2, written=2, prefill=32))
    tiered.add_step(_tier_step(1, held=3, loaded=1, hits=16, prefill=16))
    console = Console(record=True, width=140)
    console.print(tiered)
    assert "host: 3 blocks (3.0 MiB 75%)  hit rate 0.25  loaded 1 (1.0 MiB)  written 2" in console.export_text()


def test_live_config_group(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    from nanovllm.harness.conf_schema import register_configs
    from nanovllm.harness.run import config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        assert compose(config_name="config").live.mode == "off"
        cfg = compose(config_name="config", overrides=["live=web", "live.port=7000"])
        assert (cfg.live.mode, cfg.live.port, cfg.live.host) == ("web", 7000, "127.0.0.1")
        assert compose(config_name="config", overrides=["live=tui"]).live.mode == "tui"
    with pytest.raises(ValueError, match="live.mode must be one of off, web, tui"):
        LiveConfig(mode="gui")


# -- a real run, watched in a real browser --------------------------------------------------------------------------

def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _dashboard_url(proc: subprocess.Popen) -> str:
    """The live dashboard's URL, as the run prints it."""
    for line in proc.stdout:
        match = re.match(r"live dashboard: (http://\S+)", line)
        if match:
            return match.group(1)
    raise AssertionError(f"no dashboard URL printed; stderr:\n{proc.stderr.read()[-3000:]}")


def _open_dashboard(pw, playwright, url: str, height: int):  # type: ignore[no-untyped-def]
    """A headless chromium page on the dashboard at ``url``, once it shows a step count: (browser, page)."""
    browser = pw.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": 1400, "height": height})
    for _ in range(60):  # the dashboard process may still be importing bokeh
        try:
            page.goto(url)
            break
        except playwright.Error:
            time.sleep(1)
    page.wait_for_selector(".nv-step", timeout=120_000)
    return browser, page


@pytest.mark.skipif(_chromium() is None, reason="no chromium on this machine (apt-get install -y chromium)")
def test_watch_a_real_run_in_headless_chromium(tmp_path: Path) -> None:
    """A real run with a host KV tier below a pool too small for its prompts' shared prefixes: the charts draw,
    the counts grow while it runs, and the tier row shows blocks loaded back from the tier."""
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[test])")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # Arrivals spread over ~30 s, so the run is still going while the page loads and is read twice. Four
    # 48-token prefixes (12 blocks) do not fit the 8-block pool beside the requests: the prefix allocator
    # evicts them to the host tier, and a later request of the same prefix loads them back.
    command = [sys.executable, "-m", "nanovllm.run", "live=web", "live.port=0", "workload=synthetic",
               "workload.num_requests=16", "workload.request_rate=0.5", "workload.input_len.kind=fixed",
               "workload.input_len.mean=8", "workload.output_len.kind=fixed", "workload.output_len.mean=3",
               "workload.num_prefix_groups=4", "workload.prefix_len=48", "engine.num_kv_blocks=8",
               "engine.max_model_len=512", "allocator=prefix", "kv_offload=host", f"kv_offload.capacity={32 * MIB}",
               "monitor.calibrate=false", "progress=false", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = _dashboard_url(proc)
        with playwright.sync_playwright() as pw:
            browser, page = _open_dashboard(pw, playwright, url, height=1500)

            def read() -> tuple[int, int]:
                return int(page.locator(".nv-step").inner_text()), int(page.locator(".nv-finished").inner_text())

            first = read()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not all(b > a for a, b in zip(first, read())):
                time.sleep(1)
            second = read()
            assert second[0] > first[0] and second[1] > first[1], (first, second)
            assert page.locator("canvas").count() >= 6  # the time series, the Gantt and the block map drew
            assert not page.locator(".nv-proposed").is_visible()  # no speculation: no speculation charts
            assert page.locator(".bk-data-table").count() >= 1 or page.locator("text=p50 ttft").count() >= 1
            page.wait_for_selector(".nv-tier-loaded", state="visible", timeout=60_000)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and float(page.locator(".nv-tier-loaded").inner_text()) == 0:
                time.sleep(1)
            assert float(page.locator(".nv-tier-loaded").inner_text()) > 0   # MiB loaded back from the host tier
            assert page.locator(".nv-tier-name").inner_text() == "host"
            assert page.locator("canvas").count() >= 8  # and the tier row's two charts
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)  # kept in pytest's tmp dir
            browser.close()  # the browser goes away mid-run: the run must not care
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["completed"] == 16 and metrics["kv_tiers"]["host"]["blocks_loaded"] > 0
        assert json.loads((run_dir / "engine.json").read_text())["kv_tiers"] == {"host": 32 * MIB}
        assert (run_dir / "blocks.jsonl").stat().st_size > 0 and (tmp_path / "dashboard.png").stat().st_size > 10_000
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(_chromium() is None, reason="no chromium on this machine (apt-get install -y chromium)")
def test_watch_speculative_decoding_in_headless_chromium(tmp_path: Path) -> None:
    """A real run with n-gram speculation: the speculation charts draw, and their counts grow while it runs."""
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[test])")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # Readable text prompts give the n-gram proposer suffixes to match; arrivals spread over ~25 s, so the run
    # (and its dashboard, which closes with it) is still going while the page loads and is read twice.
    command = [sys.executable, "-m", "nanovllm.run", "live=web", "live.port=0", "speculative=ngram",
               "workload=synthetic", "workload.num_requests=16", "workload.request_rate=0.64",
               "workload.prompt_kind=text", "workload.input_len.kind=fixed", "workload.input_len.mean=48",
               "workload.output_len.kind=fixed", "workload.output_len.mean=24", "engine.num_kv_blocks=32",
               "engine.max_model_len=512", "monitor.calibrate=false", "progress=false", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = _dashboard_url(proc)
        with playwright.sync_playwright() as pw:
            browser, page = _open_dashboard(pw, playwright, url, height=2000)
            page.wait_for_selector(".nv-proposed", state="visible", timeout=120_000)

            def read() -> int:
                return int(page.locator(".nv-proposed").inner_text())

            first = read()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and read() <= first:
                time.sleep(1)
            assert read() > first, first
            acceptance = page.locator(".nv-acceptance").inner_text()
            assert 0.0 <= float(acceptance) <= 1.0
            assert float(page.locator(".nv-accepted-length").inner_text()) >= 1.0
            assert page.locator("canvas").count() >= 10  # the six run charts and the four speculation charts
            assert not page.locator(".nv-tier-loaded").is_visible()  # no kv_offload: no tier row
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)  # kept in pytest's tmp dir
            browser.close()
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["completed"] == 16 and metrics["spec_decode_num_draft_tokens"] > 0
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
