"""Faults injected into a run, each ending in one clear error naming its cause (with every request written
out), or recovered from: a plugin raising mid-run, non-finite logits, an unwritable run directory, a damaged
cache of converted weights, a truncated or malformed GGUF or trace file."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.attention.torch_backend import TorchAttention
from nanovllm.engine.protocol import StepError
from nanovllm.models import loader
from nanovllm.sampling import INVALID_TOKEN, Sampler
from helpers import TINY, cli_env, one_error_line, run_cli

# -- non-finite logits ---------------------------------------------------------------------------------------------


def test_the_sampler_never_samples_from_non_finite_logits():
    logits = torch.randn(4, 50)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, :10] = float("-inf")  # -inf is a legitimate "never this token"
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, top_k=5)]
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    tokens = Sampler()(logits, params, generators)
    assert tokens[1] == INVALID_TOKEN and tokens[2] == INVALID_TOKEN
    assert tokens[0] == int(logits[0].argmax()) and 10 <= tokens[3] < 50


class NaNOnFirstStep(TorchAttention):
    """The reference backend, except that on the first step the last layer's output for the batch's first
    sequence is NaN: that request's logits are garbage, every other row is untouched."""

    registered_name = "nan_on_first_step"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.steps = 0
        self.first_rows = 0

    def plan(self, meta):
        super().plan(meta)
        self.steps += 1
        self.first_rows = meta.query_lens[0]

    def forward(self, layer, q, k, v):
        out = super().forward(layer, q, k, v)
        if self.steps == 1 and layer == len(self.kv_caches) - 1:
            out = out.clone()
            out[: self.first_rows] = float("nan")
        return out


def test_a_request_with_non_finite_logits_fails_with_a_reason_and_the_others_finish(llm):
    r = llm.engine.runner
    backend = NaNOnFirstStep(r.num_heads, r.num_kv_heads, r.head_dim, r.head_dim ** -0.5)
    # warmup=False: the fault is keyed to the backend's first plan(), which the warm-up's batches would take.
    poisoned = LLM(attention=backend, num_kv_blocks=64, max_model_len=256, warmup=False)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):"]
    [expected] = [o.token_ids for o in llm.generate(prompts[1:], params, use_tqdm=False)]
    engine = poisoned.engine
    requests = [engine.make_request(p, params) for p in prompts]
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    bad, good = requests
    assert bad.status.value == "failed" and "non-finite logits" in bad.error and bad.num_output_tokens == 0
    assert good.status.value == "finished" and good.output_token_ids == expected
    assert engine.allocator.num_free_blocks() == engine.allocator.num_blocks


# -- plugins that raise mid-run ------------------------------------------------------------------------------------

class ExplodingAttention(TorchAttention):
    registered_name = "exploding"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls = 0

    def plan(self, meta):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("kernel exploded")
        super().plan(meta)


def test_an_attention_backend_that_raises_is_named_and_the_llm_stays_usable(llm):
    r = llm.engine.runner
    backend = ExplodingAttention(r.num_heads, r.num_kv_heads, r.head_dim, r.head_dim ** -0.5)
    flaky = LLM(attention=backend, num_kv_blocks=64, max_model_len=256, warmup=False)  # the fault counts steps
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(StepError, match=r"step 2 failed in attention backend 'exploding' "
                                        r"\(ExplodingAttention\.plan\): RuntimeError: kernel exploded"):
        flaky.generate(["Hello", "The sky is"], params, use_tqdm=False)
    engine = flaky.engine
    assert not engine.has_unfinished() and engine.allocator.num_free_blocks() == engine.allocator.num_blocks
    [out] = flaky.generate(["Hello"], params, use_tqdm=False)   # the backend recovered after one fault
    assert len(out.token_ids) == 6


FLAKY_ALLOCATOR = '''
from allocators.paged import PagedAllocator
from nanovllm import register_allocator


@register_allocator("flaky")
class Flaky(PagedAllocator):
    def allocate(self, request, num_new_tokens):
        if request.request_id == "4":  # admitted only once earlier requests have finished (2 seats)
            raise OSError("the allocator lost its mind")
        super().allocate(request, num_new_tokens)
'''


def test_an_allocator_that_raises_mid_run_is_one_error_line_and_every_request_is_written(tmp_path):
    (tmp_path / "flaky.py").write_text(FLAKY_ALLOCATOR)
    run_dir = tmp_path / "run"
    overrides = [o for o in TINY if not o.startswith(("workload.num_requests", "workload.output_len.mean"))]
    proc = run_cli(tmp_path, "plugins=[flaky.py]", "allocator.name=flaky", *overrides, "workload.num_requests=6",
                   "workload.output_len.mean=24", "workload.ignore_eos=true", "engine.max_num_seqs=2",
                   "engine.block_size=4", "progress=false", f"hydra.run.dir={run_dir}")
    line = one_error_line(proc)
    assert "in allocator 'flaky' (Flaky.allocate): OSError: the allocator lost its mind" in line
    records = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert sorted(r["request_id"] for r in records) == [str(i) for i in range(6)]
    assert any(r["finish_reason"] == "length" for r in records)
    assert all(r["finish_reason"] == "length" or r["error"] == "engine fault: StepError" for r in records)


# -- run files -----------------------------------------------------------------------------------------------------

def test_an_unwritable_run_directory_is_one_error_line(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "steps.jsonl").mkdir(parents=True)  # the path is taken (root ignores permission bits)
    proc = run_cli(tmp_path, *TINY, "progress=false", f"hydra.run.dir={run_dir}")
    line = one_error_line(proc)
    assert f"cannot write the run's files in {run_dir}" in line and "steps.jsonl" in line


# -- model files ---------------------------------------------------------------------------------------------------

@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A copy of the converted default model in a cache of this test's own (never the shared one)."""
    shared = loader.resolve_model()
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    copy = loader._gguf_cache_dir(loader.default_gguf_path())
    shutil.copytree(shared, copy)
    return copy


def test_the_conversion_cache_is_keyed_by_the_gguf_bytes_not_its_path(tmp_path, monkeypatch):
    """Each virtualenv installs the GGUF at a new path; all of them must share one 0.5 GB conversion."""
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    first, second, other = (tmp_path / d / "model.gguf" for d in ("venv-a", "venv-b", "venv-c"))
    for path, content in ((first, b"GGUF same bytes"), (second, b"GGUF same bytes"), (other, b"GGUF other bytes")):
        path.parent.mkdir()
        path.write_bytes(content)
    assert loader._gguf_cache_dir(first) == loader._gguf_cache_dir(second)
    assert loader._gguf_cache_dir(first) != loader._gguf_cache_dir(other)
    second.write_bytes(b"GGUF new bytes!")          # rewritten in place: a new key, not the stale conversion
    os.utime(second, ns=(second.stat().st_atime_ns, second.stat().st_mtime_ns + 10**9))
    assert loader._gguf_cache_dir(second) != loader._gguf_cache_dir(first)


def _digest(path: Path) -> str:
    return loader._sha256(path)


def test_a_corrupt_cached_conversion_is_detected_by_its_checksum(private_cache):
    assert loader.cached_weights_problem(private_cache) is None   # (records size and hash on first use)
    weights = private_cache / loader.WEIGHTS_FILE
    with weights.open("r+b") as f:             # flip bytes in the middle: same size, new modification time
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert "SHA-256 mismatch" in loader.cached_weights_problem(private_cache)


def test_a_truncated_cached_conversion_is_recreated_from_the_gguf(private_cache, caplog):
    weights = private_cache / loader.WEIGHTS_FILE
    good = _digest(weights)
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 3)
    assert "damaged" in loader.cached_weights_problem(private_cache)
    with caplog.at_level(logging.WARNING, logger="nanovllm.models.loader"):
        assert loader.resolve_model() == private_cache
    assert "are damaged" in caplog.text and "re-creating them from" in caplog.text
    assert _digest(weights) == good and loader.cached_weights_problem(private_cache) is None


def test_a_truncated_or_foreign_gguf_is_a_value_error_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    source = loader.default_gguf_path()
    truncated = tmp_path / "cut.gguf"
    with source.open("rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match=r"cut\.gguf' cannot be read as GGUF \(truncated or malformed\?\)"):
        loader.resolve_model(truncated)
    foreign = tmp_path / "notes.gguf"
    foreign.write_text("just some text")
    with pytest.raises(ValueError, match=r"notes\.gguf' is not a GGUF file"):
        loader.resolve_model(foreign)
    assert not any((tmp_path / "cache").glob("*/config.json"))  # nothing half-converted is left to be trusted


def test_a_truncated_gguf_through_the_cli_is_one_error_line(tmp_path):
    source = loader.default_gguf_path()
    truncated = tmp_path / "cut.gguf"
    with source.open("rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    proc = run_cli(tmp_path, f"model.path={truncated}", *TINY, "progress=false",
                   f"hydra.run.dir={tmp_path / 'run'}",
                   env=cli_env(tmp_path, NANOVLLM_CACHE=str(tmp_path / "cache")))
    assert "cannot be read as GGUF" in one_error_line(proc)


# -- trace files ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, expected", [
    (b'{"arrival_time": 0, "prompt": "hi"}\n{"arrival_time": 0.5, "pro', r"trace\.jsonl:2: invalid JSON"),
    (b'{"arrival_time": 0, "prompt": "hi"}\n\xff\xfe\x00garbage\n', r"trace\.jsonl: not UTF-8 text"),
], ids=["truncated", "binary"])
def test_a_truncated_or_binary_trace_names_the_file(tmp_path, tokenizer, content, expected):
    from nanovllm.harness.workload import TraceWorkloadConfig, generate_workload

    path = tmp_path / "trace.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=expected):
        generate_workload(TraceWorkloadConfig(path=str(path)), tokenizer)
