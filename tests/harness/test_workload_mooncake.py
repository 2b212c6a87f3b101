"""Mooncake trace replay (workload=trace on a Mooncake-format .jsonl): equal hash ids give equal token blocks,
lengths and arrivals follow the trace, the format is detected or named, and every malformed line is one
``file:line: ...`` error. The shipped sample (tests/data/mooncake_synthetic.jsonl) is synthetic."""

from __future__ import annotations

import json
import math

import pytest

from helpers import REPO, simulate
from nanovllm.harness.workload import TraceWorkloadConfig, generate_workload

SAMPLE = REPO / "tests" / "data" / "mooncake_synthetic.jsonl"


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def _by_line(requests) -> list:
    """The requests in file order (their ids are their index in arrival order; the sample's is file order)."""
    return sorted(requests, key=lambda r: int(r.request_id))


def test_equal_hash_ids_are_equal_token_blocks_across_requests(tokenizer):
    lines = _lines(SAMPLE)
    requests = _by_line(generate_workload(TraceWorkloadConfig(path=str(SAMPLE)), tokenizer))
    assert len(requests) == len(lines) == 40
    content: dict[int, tuple[int, ...]] = {}  # hash id -> the tokens of its block (its first ones, if partial)
    for line, r in zip(lines, requests):
        assert len(r.prompt) == line["input_length"] and r.max_tokens == line["output_length"]
        for i, hash_id in enumerate(line["hash_ids"]):
            block = tuple(r.prompt[i * 512:(i + 1) * 512])
            seen = content.setdefault(hash_id, block)
            n = min(len(seen), len(block))  # a partial last block is the start of the same block
            assert block[:n] == seen[:n]
            if len(block) > len(seen):
                content[hash_id] = block
    shared = [h for h in content if sum(h in line["hash_ids"] for line in lines) > 1]
    assert len(shared) >= 6  # the sample really reuses blocks: its system prompts and conversations
    blocks = [b[:100] for b in content.values()]
    assert len(set(blocks)) == len(blocks)  # different ids, different tokens


def test_arrivals_are_timestamps_in_seconds_times_time_scale(tokenizer):
    lines = _lines(SAMPLE)
    requests = generate_workload(TraceWorkloadConfig(path=str(SAMPLE), time_scale=0.5), tokenizer)
    assert [r.arrival_time for r in _by_line(requests)] == [line["timestamp"] / 1000 * 0.5 for line in lines]
    first = generate_workload(TraceWorkloadConfig(path=str(SAMPLE), max_requests=7), tokenizer)
    assert [r.prompt for r in _by_line(first)] == [r.prompt for r in _by_line(requests)[:7]]


def test_a_blocks_tokens_depend_on_its_id_and_the_seed_alone(tokenizer, tmp_path):
    rows = [{"timestamp": 0, "input_length": 32, "output_length": 2, "hash_ids": [7, 8]},
            {"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [8]}]
    cfg = dict(block_size=16, format="mooncake")
    a, b = _by_line(generate_workload(TraceWorkloadConfig(path=_write(tmp_path / "a.jsonl", rows), **cfg),
                                      tokenizer))
    assert b.prompt == a.prompt[16:26]  # id 8 at another position, cut shorter: the same tokens
    only_b, = generate_workload(TraceWorkloadConfig(path=_write(tmp_path / "b.jsonl", rows[1:]), **cfg), tokenizer)
    assert only_b.prompt == b.prompt  # whichever request meets the id first
    other_seed = _by_line(generate_workload(TraceWorkloadConfig(path=str(tmp_path / "a.jsonl"), seed=1, **cfg),
                                            tokenizer))
    assert other_seed[0].prompt != a.prompt and other_seed[1].prompt == other_seed[0].prompt[16:26]
    assert generate_workload(TraceWorkloadConfig(path=str(tmp_path / "a.jsonl"), **cfg), tokenizer) == [a, b]


def test_optional_fields_sessions_and_lines_without_hash_ids(tokenizer, tmp_path):
    path = _write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 9, "hash_ids": [1], "session_id": "chat-a"},
        {"timestamp": 1, "input_length": 9, "output_length": 3, "session_id": 4},
        {"timestamp": 2, "input_length": 9, "output_length": 3}])
    first, second, third = _by_line(generate_workload(
        TraceWorkloadConfig(path=path, block_size=16, default_output_len=11), tokenizer))
    assert (first.max_tokens, first.session_id, second.session_id, third.session_id) == (11, "chat-a", "4", None)
    assert len(second.prompt) == len(third.prompt) == 9 and second.prompt != third.prompt  # tokens of their own
    assert all(r.ignore_eos for r in (first, second, third))


def test_format_auto_detects_mooncake_and_a_named_format_ignores_the_name(tokenizer, tmp_path):
    row = {"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}
    (tmp_path / "trace.txt").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"workload\.path=.*set workload\.format"):
        generate_workload(TraceWorkloadConfig(path=str(tmp_path / "trace.txt")), tokenizer)
    request, = generate_workload(TraceWorkloadConfig(path=str(tmp_path / "trace.txt"), format="mooncake"), tokenizer)
    assert len(request.prompt) == 4
    # Read as nano-vllm's own JSONL, a Mooncake line is a line of unknown fields, named.
    with pytest.raises(ValueError, match=r"m\.jsonl:1: unknown field\(s\) 'hash_ids'"):
        generate_workload(TraceWorkloadConfig(path=_write(tmp_path / "m.jsonl", [row]), format="jsonl"), tokenizer)
    # ... and auto reads the nano-vllm trace as before.
    native, = generate_workload(TraceWorkloadConfig(path=_write(tmp_path / "n.jsonl", [
        {"arrival_time": 0.5, "prompt_len": 3}])), tokenizer)
    assert native.arrival_time == 0.5 and len(native.prompt) == 3


@pytest.mark.parametrize("kw,field", [
    (dict(format="csv"), "format"),
    (dict(block_size=0), "block_size"),
])
def test_invalid_trace_options_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"^workload\.{field}=.* is invalid: must"):
        TraceWorkloadConfig(**kw)


GOOD = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 1]}


@pytest.mark.parametrize("bad,message", [
    ('{"timestamp": 1, "input_length": 5', "invalid JSON"),
    ([1, 2], "expected a JSON object"),
    ({"input_length": 5, "hash_ids": [0]}, "'timestamp' must be a number of milliseconds >= 0, got None"),
    ({"timestamp": -3, "input_length": 5, "hash_ids": [0]}, "'timestamp' must be a number of milliseconds"),
    ({"timestamp": "soon", "input_length": 5, "hash_ids": [0]}, "'timestamp' must be a number"),
    ({"timestamp": 1, "hash_ids": [0]}, "'input_length' must be an integer >= 1, got None"),
    ({"timestamp": 1, "input_length": 0, "hash_ids": []}, "'input_length' must be an integer >= 1"),
    ({"timestamp": 1, "input_length": 5, "output_length": "ten", "hash_ids": [0]},
     "'output_length' must be an integer"),
    ({"timestamp": 1, "input_length": 5, "hash_ids": 3}, "'hash_ids' must be a list of integers >= 0"),
    ({"timestamp": 1, "input_length": 5, "hash_ids": [-1]}, "'hash_ids' must be a list of integers >= 0"),
    ({"timestamp": 1, "input_length": 5, "hash_ids": [True]}, "'hash_ids' must be a list of integers >= 0"),
    ({"timestamp": 1, "input_length": 1100, "hash_ids": [0, 1]},
     "'hash_ids' has 2 block id(s) but 'input_length' 1100 makes 3 block(s) of workload.block_size=512 tokens"),
    ({"timestamp": 1, "input_length": 5, "hash_id": [0]}, "unknown field(s) 'hash_id'"),
    ({"timestamp": 1, "input_length": 5, "session_id": [1]}, "'session_id' must be a string or an integer"),
])
def test_malformed_mooncake_line_names_file_and_line(tokenizer, tmp_path, bad, message):
    path = _write(tmp_path / "bad.jsonl", [GOOD, "", bad, GOOD])
    with pytest.raises(ValueError) as e:
        generate_workload(TraceWorkloadConfig(path=path), tokenizer)
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value) and "\n" not in str(e.value)


def test_lines_past_max_requests_are_never_read(tokenizer, tmp_path):
    path = _write(tmp_path / "t.jsonl", [GOOD, GOOD, "{not json"])
    assert len(generate_workload(TraceWorkloadConfig(path=path, max_requests=2), tokenizer)) == 2


def test_the_prefix_cache_hits_the_blocks_the_trace_shares(tokenizer, tmp_path):
    """Served by the real engine on the simulator (prefix allocator, 16-token blocks, one request at a time):
    each request finds cached exactly the leading full blocks it shares with an earlier one."""
    rows = [([0, 1, 2], 48), ([0, 1, 3], 44), ([0, 4], 20), ([0, 1, 2, 5], 60), ([6, 1, 2], 40)]
    path = _write(tmp_path / "t.jsonl", [{"timestamp": 10 * i, "input_length": n, "output_length": 2, "hash_ids": ids}
                                         for i, (ids, n) in enumerate(rows)])
    workload = generate_workload(TraceWorkloadConfig(path=path, block_size=16), tokenizer)
    assert math.isclose(workload[1].arrival_time, 0.01)
    records = {r["request_id"]: r for r in simulate("fcfs", workload, allocator="prefix", block_size=16,
                                                    clock="tokens").requests}
    # Shared from the start with an earlier request: nothing | 0,1 | 0 | 0,1,2 | nothing (block 0 differs).
    assert [records[str(i)]["num_cached_tokens"] for i in range(5)] == [0, 32, 16, 48, 0]
