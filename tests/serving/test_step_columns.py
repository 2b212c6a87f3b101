"""``StepColumns``: many steps' records column by column, as a simulated engine hands out its decode stretches
(``nanovllm/outputs.py``), and the books kept from them (``StepKeeper.offer_columns``) against the books kept
from the same records one by one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.outputs import StepColumns
from nanovllm.serving.step_records import StepKeeper, StepRecords


def _columns(start: float, durations: list[float], replica: int, first_step: int = 0) -> StepColumns:
    n = len(durations)
    starts = np.add.accumulate(np.concatenate(([start], durations)))
    context = 40 + 2 * np.arange(n)
    return StepColumns(
        ["step", "start_time", "duration", "num_decode_tokens", "num_running", "num_waiting", "kv_blocks_used",
         "kv_blocks_free", "kv_blocks_total", "context_tokens", "flops", "mfu", "spec_decode_num_accepted_tokens_per_pos"],
        {"step": np.arange(first_step, first_step + n), "start_time": starts[:-1], "duration": starts[1:] - starts[:-1],
         "context_tokens": context, "kv_blocks_used": 3 + np.arange(n) // 4, "kv_blocks_free": 50 - np.arange(n) // 4,
         "flops": 1e9 + context * 3.5, "mfu": (1e9 + context * 3.5) / (starts[1:] - starts[:-1]) / 1e15,
         # A field an aggregate keeps the last value of, varying here so that "last" is tested.
         "kv_blocks_total": 64 + replica + np.arange(n) // 5},
        {"num_decode_tokens": 2, "num_running": 2, "num_waiting": 0, "spec_decode_num_accepted_tokens_per_pos": []})


def test_records_are_the_rows_with_python_numbers_and_fresh_lists():
    steps = _columns(1.5, [0.01, 0.02, 0.03], replica=0)
    records = steps.records()
    assert [r["step"] for r in records] == [0, 1, 2] and type(records[0]["step"]) is int
    assert records[1]["start_time"] == 1.5 + 0.01 and type(records[1]["duration"]) is float
    assert records[2]["kv_blocks_total"] == 64 and list(records[0]) == steps.keys
    records[0]["spec_decode_num_accepted_tokens_per_pos"].append(1)   # each record has its own list
    assert records[1]["spec_decode_num_accepted_tokens_per_pos"] == [] == steps.record(0)[
        "spec_decode_num_accepted_tokens_per_pos"]


def test_interleave_places_each_parts_steps_in_order_and_keeps_shared_constants():
    a, b = _columns(0.0, [0.1, 0.1, 0.1], replica=0), _columns(0.05, [0.1, 0.1], replica=1)
    merged = StepColumns.interleave([a, b], np.array([0, 1, 0, 1, 0]))
    assert [r["start_time"] for r in merged.records()] == \
        [a.record(0)["start_time"], b.record(0)["start_time"], a.record(1)["start_time"], b.record(1)["start_time"],
         a.record(2)["start_time"]]
    assert "num_running" in merged.constants and "kv_blocks_total" in merged.columns
    with pytest.raises(ValueError, match="different record fields"):
        StepColumns.interleave([a, a.with_column("replica", np.zeros(3, dtype=np.int64))], np.array([0, 1]))


def test_records_made_columns_read_back_as_they_were_values_and_types():
    records = [{"step": 4, "start_time": 0.5, "duration": 0.01, "num_running": 3, "mfu": None, "ok": True,
                "per_pos": [], "kv_blocks_free": 10},
               {"step": 5, "start_time": 0.51, "duration": 0.02, "num_running": 3, "mfu": 0.25, "ok": False,
                "per_pos": [1, 2], "kv_blocks_free": 9},
               {"step": 6, "start_time": 0.53, "duration": 0.02, "num_running": 3, "mfu": None, "ok": True,
                "per_pos": [], "kv_blocks_free": 9}]
    steps = StepColumns.of_records(records)
    assert steps.records() == records and steps.keys == list(records[0])
    assert [type(value) for r in steps.records() for value in r.values()] == \
        [type(value) for r in records for value in r.values()]   # 1 stays int, True stays bool, lists stay lists
    assert steps.constants == {"num_running": 3} and steps.columns["kv_blocks_free"].dtype == np.int64
    assert steps.columns["per_pos"].dtype == object and steps.record(1)["per_pos"] == [1, 2]
    # One after the other, then picked in any order.
    both = StepColumns.concatenate([steps, StepColumns.of_records(records[:1])])
    assert both.records() == records + records[:1]
    assert both.select(np.array([3, 1])).records() == [records[0], records[1]]


@settings(max_examples=40, deadline=None)
@given(spec=st.sampled_from(["every:1", "every:3", "interval:0.05", "interval:0.3"]),
       runs=st.lists(st.tuples(st.integers(0, 2), st.lists(st.floats(0.001, 0.2), min_size=1, max_size=30)),
                     min_size=1, max_size=6))
def test_keeping_steps_as_columns_keeps_what_offering_them_one_by_one_keeps(spec, runs):
    """Bounded books of runs of steps from up to three replicas: the records kept, and the totals over every
    step, are exactly those of offering each record in turn."""
    clocks = [0.0, 0.013, 0.027]
    by_columns, one_by_one = StepKeeper(StepRecords.parse(spec)), StepKeeper(StepRecords.parse(spec))
    kept_columns, kept_one = [], []
    step = 0
    for replica, durations in runs:
        steps = _columns(clocks[replica], durations, replica, step).with_column(
            "replica", np.full(len(durations), replica))
        clocks[replica] = float(steps.columns["start_time"][-1] + steps.columns["duration"][-1])
        step += len(durations)
        kept_columns += by_columns.offer_columns(steps)
        for record in steps.records():
            kept_one += one_by_one.offer(dict(record))
    kept_columns += by_columns.flush()
    kept_one += one_by_one.flush()
    assert kept_columns == kept_one
    assert by_columns.totals == one_by_one.totals and by_columns.num_steps == one_by_one.num_steps
