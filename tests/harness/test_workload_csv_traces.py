"""CSV trace replay (workload=trace on Azure's LLM inference traces, Vidur's processed traces and BurstGPT): the
format is detected from the header or named, arrivals are relative to the first request and scaled, lengths are
the recorded ones, BurstGPT's filters and zero-token rows behave as documented, and every malformed line is one
``file:line: ...`` error. The files are small ones written here in the public files' layouts."""

from __future__ import annotations

import math

import pytest

from helpers import simulate
from nanovllm.harness.workload import TraceWorkloadConfig, generate_workload
from nanovllm.harness.workload.csv_traces import parse_timestamp

AZURE_2023 = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.0000000,12,3
"""
AZURE_2024 = """TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-10 00:00:00.009930+00:00,1020,12
2024-05-10 00:00:01.509930+00:00,31,7
"""
VIDUR = """arrived_at,num_prefill_tokens,num_decode_tokens
0.0,374,44
4.314579,396,109
4.541877,879,55
"""
BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,230,1317,API log
118,GPT-4,417,276,693,Conversation log
120,GPT-4,300,0,300,API log
130,ChatGPT,50,7,57,Conversation log
"""


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _read(path: str, tokenizer, **kw):
    """The requests in file order (ids are the arrival order, which is file order in these files)."""
    return sorted(generate_workload(TraceWorkloadConfig(path=path, **kw), tokenizer), key=lambda r: int(r.request_id))


def test_azure_2023_arrivals_relative_to_the_first_request_and_recorded_lengths(tokenizer, tmp_path):
    path = _write(tmp_path, "AzureLLMInferenceTrace_conv.csv", AZURE_2023)
    requests = _read(path, tokenizer)
    # Seven fractional digits: 50.9951690 - 46.6805900 = 4.314579 s, exactly as Vidur's processed copy has it.
    assert [r.arrival_time for r in requests] == pytest.approx([0.0, 4.314579, 4.31941], abs=1e-6)
    assert [(len(r.prompt), r.max_tokens) for r in requests] == [(374, 44), (396, 109), (12, 3)]
    assert all(r.ignore_eos and isinstance(r.prompt, list) for r in requests)
    assert len({tuple(r.prompt[:12]) for r in requests}) == 3  # each prompt its own random tokens
    special = set(tokenizer.all_special_ids)
    assert not any(t in special for r in requests for t in r.prompt)
    scaled = _read(path, tokenizer, time_scale=0.5, max_requests=2)
    assert [r.arrival_time for r in scaled] == pytest.approx([0.0, 4.314579 / 2], abs=1e-6)
    assert [r.prompt for r in scaled] == [r.prompt for r in requests[:2]]  # same seed, same prompts


def test_azure_2024_timestamps_with_a_utc_offset(tokenizer, tmp_path):
    requests = _read(_write(tmp_path, "AzureLLMInferenceTrace_conv_1week.csv", AZURE_2024), tokenizer)
    assert [r.arrival_time for r in requests] == pytest.approx([0.0, 1.5], abs=1e-6)
    assert [(len(r.prompt), r.max_tokens) for r in requests] == [(1020, 12), (31, 7)]
    # The offset is honoured: the same instant written in another zone is the same second.
    assert parse_timestamp("2024-05-10 02:00:00.5+02:00") == parse_timestamp("2024-05-10 00:00:00.500000")


def test_vidur_processed_trace_and_its_arrivals_in_seconds(tokenizer, tmp_path):
    requests = _read(_write(tmp_path, "splitwise_conv.csv", VIDUR), tokenizer, time_scale=2.0)
    assert [r.arrival_time for r in requests] == pytest.approx([0.0, 2 * 4.314579, 2 * 4.541877])
    assert [(len(r.prompt), r.max_tokens) for r in requests] == [(374, 44), (396, 109), (879, 55)]


def test_arrivals_start_at_the_earliest_request_even_when_the_file_does_not(tokenizer, tmp_path):
    text = "arrived_at,num_prefill_tokens,num_decode_tokens\n12.5,4,1\n10.0,5,1\n"
    requests = generate_workload(TraceWorkloadConfig(path=_write(tmp_path, "t.csv", text)), tokenizer)
    assert [(r.arrival_time, len(r.prompt)) for r in requests] == [(0.0, 5), (2.5, 4)]  # sorted by arrival


def test_burstgpt_filters_by_model_and_log_type(tokenizer, tmp_path):
    path = _write(tmp_path, "BurstGPT_1.csv", BURSTGPT)
    every = _read(path, tokenizer)  # the failure (0 response tokens) is left out by default
    assert [(r.arrival_time, len(r.prompt), r.max_tokens) for r in every] == [
        (0.0, 472, 18), (40.0, 1087, 230), (113.0, 417, 276), (125.0, 50, 7)]
    chatgpt = _read(path, tokenizer, models=["ChatGPT"])
    assert [r.max_tokens for r in chatgpt] == [18, 230, 7]
    conversations = _read(path, tokenizer, models=["ChatGPT", "GPT-4"], log_types=["Conversation log"])
    assert [(r.arrival_time, r.max_tokens) for r in conversations] == [(0.0, 18), (113.0, 276), (125.0, 7)]
    gpt4_api = _read(path, tokenizer, models=["GPT-4"], log_types=["API log"], zero_tokens="one")
    assert [(r.arrival_time, len(r.prompt), r.max_tokens) for r in gpt4_api] == [(0.0, 300, 1)]
    # max_requests counts the rows the filters keep.
    assert [r.max_tokens for r in _read(path, tokenizer, models=["ChatGPT"], max_requests=2)] == [18, 230]
    with pytest.raises(ValueError, match=r"BurstGPT_1\.csv: no row passes .*'Model' values seen: ChatGPT, GPT-4"):
        _read(path, tokenizer, models=["gpt-4"])


def test_zero_token_rows_skip_one_or_error(tokenizer, tmp_path):
    path = _write(tmp_path, "b.csv", BURSTGPT)
    assert len(_read(path, tokenizer, zero_tokens="skip")) == 4
    kept = _read(path, tokenizer, zero_tokens="one")
    assert [r.max_tokens for r in kept] == [18, 230, 276, 1, 7]  # the failure keeps its arrival and prompt
    with pytest.raises(ValueError, match=r"b\.csv:5: 'Response tokens' is 0 \(set workload\.zero_tokens=skip"):
        _read(path, tokenizer, zero_tokens="error")
    azure = _write(tmp_path, "a.csv", AZURE_2023 + "2023-11-16 18:15:52.0000000,0,5\n")
    assert len(_read(azure, tokenizer)) == 3
    with pytest.raises(ValueError, match=r"a\.csv:5: 'ContextTokens' is 0"):
        _read(azure, tokenizer, zero_tokens="error")


def test_format_auto_reads_the_header_and_a_named_format_ignores_the_name(tokenizer, tmp_path):
    txt = _write(tmp_path, "trace.txt", VIDUR)
    with pytest.raises(ValueError, match=r"workload\.path=.*\.csv \(Azure, Vidur or BurstGPT\), or set workload\."):
        generate_workload(TraceWorkloadConfig(path=txt), tokenizer)
    assert len(generate_workload(TraceWorkloadConfig(path=txt, format="vidur"), tokenizer)) == 3
    with pytest.raises(ValueError, match=r"other\.csv:1: columns a,b match no known CSV trace .*set workload\.format"):
        generate_workload(TraceWorkloadConfig(path=_write(tmp_path, "other.csv", "a,b\n1,2\n")), tokenizer)
    # A named format whose columns the file lacks says which, on the header's line.
    with pytest.raises(ValueError, match=r"v\.csv:1: a azure trace needs the column\(s\) TIMESTAMP, ContextTokens"):
        generate_workload(TraceWorkloadConfig(path=_write(tmp_path, "v.csv", VIDUR), format="azure"), tokenizer)
    with pytest.raises(ValueError, match=r"workload\.models=\['ChatGPT'\]: only BurstGPT traces"):
        generate_workload(TraceWorkloadConfig(path=_write(tmp_path, "v2.csv", VIDUR), models=["ChatGPT"]), tokenizer)


@pytest.mark.parametrize("kw,field", [
    (dict(zero_tokens="drop"), "zero_tokens"),
    (dict(models="ChatGPT"), "models"),
    (dict(log_types=[]), "log_types"),
])
def test_invalid_csv_options_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"^workload\.{field}=.* is invalid: must"):
        TraceWorkloadConfig(**kw)


@pytest.mark.parametrize("header,bad,message", [
    (AZURE_2023, "2023-11-16T18:15:47,12", "2 cell(s) where the header has 3 columns"),
    (AZURE_2023, "16/11/2023 18:15,12,3", "'TIMESTAMP' must be a date and time like 2023-11-16"),
    (AZURE_2023, "2023-11-16 18:15:47.1,-2,3", "'ContextTokens' must be an integer >= 0, got '-2'"),
    (AZURE_2023, "2023-11-16 18:15:47.1,12,3.5", "'GeneratedTokens' must be an integer >= 0, got '3.5'"),
    (VIDUR, "soon,4,1", "'arrived_at' must be a number of seconds, got 'soon'"),
    (VIDUR, "nan,4,1", "'arrived_at' must be a number of seconds, got 'nan'"),
    (VIDUR, "1.0,four,1", "'num_prefill_tokens' must be an integer >= 0, got 'four'"),
    (BURSTGPT, "7,ChatGPT,12,x,12,API log", "'Response tokens' must be an integer >= 0, got 'x'"),
])
def test_malformed_csv_line_names_file_and_line(tokenizer, tmp_path, header, bad, message):
    lines = header.splitlines()
    path = _write(tmp_path, "bad.csv", "\n".join([lines[0], lines[1], "", bad, lines[2]]) + "\n")
    with pytest.raises(ValueError) as e:
        generate_workload(TraceWorkloadConfig(path=path), tokenizer)
    assert str(e.value).startswith(f"{path}:4: ") and message in str(e.value) and "\n" not in str(e.value)


def test_rows_past_max_requests_are_never_read(tokenizer, tmp_path):
    path = _write(tmp_path, "t.csv", VIDUR + "not a number,1,1\n")
    assert len(generate_workload(TraceWorkloadConfig(path=path, max_requests=3), tokenizer)) == 3
    with pytest.raises(ValueError, match=r"t\.csv:5: "):
        generate_workload(TraceWorkloadConfig(path=path), tokenizer)


def test_a_csv_trace_replays_through_the_simulator(tokenizer, tmp_path):
    """Served by the real engine on the simulator's token clock: every request runs to its recorded output
    length, none starts before its arrival."""
    text = "arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{0.05 * i},{20 + 3 * i},{1 + i % 4}\n" for i in range(12))
    workload = generate_workload(TraceWorkloadConfig(path=_write(tmp_path, "t.csv", text)), tokenizer)
    result = simulate("fcfs", workload, clock="tokens")
    by_id = {r["request_id"]: r for r in result.requests}
    assert len(by_id) == 12
    for request in workload:
        record = by_id[request.request_id]
        assert record["num_output_tokens"] == request.max_tokens
        assert record["num_prompt_tokens"] == len(request.prompt)
        assert record["first_scheduled_time"] >= record["arrival_time"] - 1e-9
        assert math.isclose(record["arrival_time"], request.arrival_time, abs_tol=1e-9)


def test_the_hydra_trace_config_takes_the_csv_options(tokenizer, tmp_path):
    """``workload=trace workload.models=[...]`` composes (conf/workload/trace.yaml has every new key) and the
    composed DictConfig reads the trace as the dataclass does."""
    from hydra import compose, initialize_config_dir

    from nanovllm.harness.conf_schema import register_configs
    from nanovllm.harness.run import config_dir

    path = _write(tmp_path, "BurstGPT_1.csv", BURSTGPT)
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "workload=trace", f"workload.path={path}", "workload.models=[GPT-4]", "workload.zero_tokens=one",
            "workload.log_types=[Conversation log,API log]"])
    assert (cfg.workload.format, cfg.workload.zero_tokens) == ("auto", "one")
    assert [r.max_tokens for r in generate_workload(cfg.workload, tokenizer)] == [276, 1]
