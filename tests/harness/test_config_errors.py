"""Bad overrides of every config group give one ``error:`` line naming the field, never a traceback.

``python -m nanovllm.run`` checks a config in two stages: Hydra composes it against the schema (a wrong type, a
misspelt key, an unknown group option), then ``check_config`` checks values and plugin options before the model
loads. Both stages are run here in-process, the way the entry point runs them (Hydra's compose API, the same
``composition_error_line`` the entry point prints, then ``check_config``), so hundreds of cases cost seconds;
``tests/harness/test_run.py`` runs a handful of them through the real command line. The table covers every group in
``conf/`` and every field of the schema (a test checks that, so a new group must bring its cases); the
hypothesis test throws junk at every leaf of the composed configs of every scheduler and group option.

What cannot run on this machine (``attention=flashinfer`` or ``engine.device=cuda`` without CUDA) is refused
by ``check_config`` too, and ``LLM(...)`` / ``LLMEngine`` refuse it, and every bad plugin spec, before they load
the model or the kernels: the tests below make loading them fail loudly and see the right error instead.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import CompactHydraException
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import DictConfig

from helpers import REPO
from nanovllm.harness.conf_schema import RunConfig, register_configs
from nanovllm.harness.errors import composition_error_line, user_errors
from nanovllm.harness.objective import ObjectiveConfig
from nanovllm.harness.run import check_config, config_dir

NOT_RUN_GROUPS = {"experiment", "hydra"}  # conf/ groups that configure sweeps, not a run


def _check(cfg: DictConfig) -> None:
    """What the entry point checks after composition and before the model loads (``_task`` -> ``run``)."""
    ObjectiveConfig(**cfg.objective)
    check_config(cfg)


def _error_line(build) -> str | None:
    """The entry point's stderr for a config: one ``error:`` line, or None when the config is valid."""
    try:
        cfg = build()
    except CompactHydraException as exc:
        return composition_error_line(exc)
    try:
        _check(cfg)
    except user_errors() as exc:
        return f"error: {exc}"
    return None


@pytest.fixture(scope="module")
def compose_cfg():
    register_configs()

    def _compose(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))

    return _compose


def _assert_one_line(line: str | None, expected: list[str]) -> None:
    assert line is not None, "the config was accepted"
    assert "\n" not in line and line.startswith("error: ") and "Traceback" not in line, line
    for text in expected:
        assert text in line, f"{text!r} not in {line!r}"


SIM_ANALYTICAL = ["runner=sim", "runner.step_time=analytical", "hardware=h100_sxm"]

# (overrides, texts the error line must hold). The first text names the field.
CASES: list[tuple[list[str], list[str]]] = [
    # engine (EngineConfig through the schema)
    (["engine.num_kv_blocks=many"], ["engine.num_kv_blocks", "Integer"]),
    (["engine.num_kv_blokcs=8"], ["engine.num_kv_blokcs"]),
    (["engine.max_num_seqs=0"], ["engine.max_num_seqs", ">= 1"]),
    (["engine.kv_cache_fraction=[0.5]"], ["engine.kv_cache_fraction"]),
    (["engine.dtype=float64"], ["engine.dtype", "float32"]),
    # scheduler: the group, its name, and each policy's options (types from the constructor, ranges by it)
    (["scheduler=nope"], ["scheduler/nope", "fcfs", "priority"]),
    (["scheduler.name=5"], ["scheduler.name", "fcfs"]),
    (["scheduler.name=priorty"], ["unknown policy 'priorty'", "Did you mean 'priority'"]),
    (["scheduler.typo=1"], ["scheduler.typo", "+scheduler.typo=1"]),
    (["+scheduler.typo=1"], ["scheduler='fcfs' does not take options", "typo"]),
    (["scheduler=priority", "scheduler.preempt_for_priority=maybe"], ["scheduler.preempt_for_priority", "bool"]),
    (["scheduler=mlfq", "scheduler.quantum=abc"], ["scheduler.quantum", "int", "'abc'"]),
    (["scheduler=mlfq", "scheduler.num_levels=0"], ["scheduler.num_levels", ">= 1"]),
    (["scheduler=mlfq", "scheduler.preempt=1"], ["scheduler.preempt", "bool"]),
    (["scheduler=fair", "scheduler.input_weight=-1"], ["scheduler.input_weight", ">= 0"]),
    (["scheduler=fair", "scheduler.output_weight=lots"], ["scheduler.output_weight", "float"]),
    (["scheduler=sjf", "scheduler.output_per_prompt_token=-2"], ["scheduler.output_per_prompt_token", ">= 0"]),
    (["scheduler=sjf", "scheduler.predictor=psychic"], ["scheduler.predictor", "oracle"]),
    (["scheduler=edf", "scheduler.default_slo_ms=abc"], ["scheduler.default_slo_ms", "float | None"]),
    (["scheduler=edf", "scheduler.deadline=never"], ["scheduler.deadline", "ttft"]),
    (["scheduler=sarathi", "scheduler.token_budget=0"], ["scheduler.token_budget", ">= 1"]),
    (["scheduler=lpm", "scheduler.max_wait=-1"], ["scheduler.max_wait", "> 0"]),
    (["scheduler=random", "scheduler.seed=[1]"], ["scheduler.seed", "int"]),
    # allocator
    (["allocator=radix", "allocator.eviction=mru"], ["allocator.eviction", "lru"]),
    (["allocator.name=[paged]"], ["allocator.name"]),
    (["allocator=nope"], ["allocator/nope", "paged"]),
    (["+allocator.num_blocks=4"], ["allocator='paged' does not take options", "num_blocks"]),
    # attention
    (["attention.name=nope"], ["unknown attention backend 'nope'", "torch"]),
    (["+attention.bogus=1"], ["attention=", "bogus"]),
    *([(["attention=flashinfer"], ["attention backend 'flashinfer' cannot run on cpu", "CUDA device"]),
       (["engine.device=cuda"], ["engine.device='cuda'", "CUDA is not available"])]
      if not torch.cuda.is_available() else []),
    # workload: chat (default), synthetic, trace
    (["workload.num_requests=abc"], ["workload.num_requests", "Integer"]),
    (["workload.num_request=3"], ["workload.num_request"]),
    (["workload.request_rate=-1"], ["workload.request_rate", "> 0"]),
    (["workload.priority_weights=[1,2,3]"], ["workload.priority_weights", "priority_classes"]),
    (["workload.priority_classes=[a]"], ["workload.priority_classes", "Integer"]),
    (["workload=synthetic", "workload.input_len.kind=weird"], ["workload.input_len.kind", "uniform"]),
    (["workload=synthetic", "workload.output_len.mean=0"], ["workload.output_len.mean"]),
    (["workload=synthetic", "workload.ignore_eos=maybe"], ["workload.ignore_eos", "bool"]),
    (["workload=trace"], ["workload.path"]),
    (["workload=trace", "workload.path=/nonexistent/trace.jsonl"], ["workload.path", "no such file"]),
    (["workload.name=weird"], ["workload.name", "synthetic"]),
    # runner
    (["runner.name=nope"], ["runner.name", "real, sim"]),
    (["+runner.bogus=1"], ["runner", "bogus"]),
    (["runner=sim", "runner.step_time=fast"], ["runner.step_time", "calibrated"]),
    (["runner=sim", "runner.profile=/nonexistent/profile.yaml"], ["runner.profile", "no such file"]),
    (["runner=sim", "runner.replay_run=/nonexistent/run"], ["runner.replay_run", "no such file"]),
    # hardware
    (["runner=sim", "runner.step_time=analytical"], ["hardware is not set", "hardware=h100_sxm"]),
    ([*SIM_ANALYTICAL, "hardware.memory_bandwidth=-1"], ["hardware.memory_bandwidth", "> 0"]),
    ([*SIM_ANALYTICAL, "hardware.peak_flops=5"], ["hardware.peak_flops"]),
    ([*SIM_ANALYTICAL, "hardware.memory_fraction=2"], ["hardware.memory_fraction", "(0, 1]"]),
    ([*SIM_ANALYTICAL, "+hardware.bandwith=1"], ["hardware", "bandwith"]),
    (["hardware=gpu9000"], ["hardware/gpu9000", "h100_sxm"]),
    # model
    (["model.path=/nonexistent/model"], ["model.path", "no such file"]),
    (["model=gguf"], ["model.path"]),
    (["model.revision=main"], ["model.revision"]),
    # monitor, slo, objective, live, logger
    (["monitor.peak_flops=-1"], ["monitor.peak_flops", "> 0"]),
    (["monitor.calibrate=maybe"], ["monitor.calibrate", "bool"]),
    (["slo.ttft_ms=0"], ["slo.ttft_ms", "> 0"]),
    (["records.steps=sometimes"], ["records.steps must be all, every:N", "'sometimes'"]),
    (["records.steps=every:0"], ["records.steps", "N >= 1", "'every:0'"]),
    (["slo.e2el_ms=[1]"], ["slo.e2el_ms"]),
    (["slo.ttft=100"], ["slo.ttft"]),
    (["objective.direction=up"], ["objective.direction", "maximize"]),
    (["objective.metric=[a]"], ["objective.metric"]),
    (["live=web", "live.port=70000"], ["live.port", "65535"]),
    (["live.update_ms=abc"], ["live.update_ms", "Integer"]),
    (["live=cinema"], ["live/cinema", "web"]),
    (["server.port=abc"], ["server.port", "Integer"]),
    (["router.name=nope"], ["unknown router 'nope'", "round_robin"]),
    (["router=least_loaded", "router.metric=bytes"], ["router.metric", "requests, tokens"]),
    (["router=consistent_hash", "router.virtual_nodes=0"], ["router.virtual_nodes", ">= 1"]),
    (["kv_transfer.name=nope"], ["unknown kv_transfer 'nope'", "shared_memory"]),
    (["kv_transfer=nvlink", "kv_transfer.latency=-1"], ["kv_transfer.latency", ">= 0"]),
    # speculative: the group, the proposer's name and options, and the number of tokens
    (["speculative=ngram", "speculative.num_tokens=0"], ["speculative.num_speculative_tokens", ">= 1"]),
    (["speculative=ngram", "speculative.method=ngrm"], ["speculative.method", "ngram"]),
    (["speculative=ngram", "+speculative.typo=1"], ["speculative='ngram' does not take options", "typo"]),
    # kv_offload: the group, each tier's options, the offload policy, and the engine's preemption mode
    (["kv_offload=hst"], ["kv_offload/hst", "host"]),
    (["kv_offload=host", "kv_offload.capacity=-1"], ["kv_offload.capacity", ">= 1", "-1"]),
    (["kv_offload=host_disk", "kv_offload.below.kv_dtype=int4"], ["kv_offload.below.kv_dtype", "auto or int8", "int4"]),
    (["kv_offload=host", "kv_offload.eviction=mru"], ["kv_offload.eviction", "lru", "'mru'"]),
    (["kv_offload=host", "kv_offload.policy=sometimes"], ["kv_offload.policy", "'sometimes'", "write_through"]),
    (["kv_offload=host", "+kv_offload.typo=1"], ["kv_offload='host' does not take options", "typo"]),
    (["engine.preemption_mode=swop"], ["engine.preemption_mode", "recompute or swap", "'swop'"]),
    (["cluster.replicas=abc"], ["cluster.replicas", "Integer"]),
    (["cluster.replicas=0"], ["cluster.replicas", ">= 1"]),
    (["runner=sim", "cluster.replicas=2", "+cluster.replica_overrides={7: {max_num_seqs: 2}}"],
     ["cluster.replica_overrides", "not a replica index"]),   # the values themselves: python -m nanovllm.serve
    (["logger=wandb", "logger.mode=weird"], ["logger.mode", "offline"]),
    (["logger=wandb", "logger.tags=5"], ["logger.tags", "list[str]"]),
    (["logger.name=nope"], ["unknown logger 'nope'", "jsonl"]),
    # the top-level fields
    (["seed=1.5"], ["seed", "Integer"]),
    (["seed=-1"], ["seed", ">= 0"]),
    (["temperature=-1"], ["temperature", ">= 0"]),
    (["temperature=abc"], ["temperature", "Float"]),
    (["plugins=5"], ["plugins", "list"]),
    (["plugins=[no_such_plugin_module]"], ["no_such_plugin_module", "failed to import"]),
    (["progress=maybe"], ["progress", "bool"]),
    (["bogus=1"], ["bogus"]),
    (["engine.num_kv_blocks=["], ["cannot parse override", "engine.num_kv_blocks=["]),
]


def _group(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0].split(".", 1)[0]


def test_the_table_covers_every_group_and_field() -> None:
    covered = {_group(override) for overrides, _ in CASES for override in overrides[-1:]}
    groups = {p.name for p in (REPO / "conf").iterdir() if p.is_dir() and not p.name.startswith("_")}
    fields = set(RunConfig.__dataclass_fields__)
    assert groups - NOT_RUN_GROUPS <= covered, f"no case for conf/{sorted(groups - NOT_RUN_GROUPS - covered)}"
    assert fields <= covered, f"no case for the schema's {sorted(fields - covered)}"


@pytest.mark.parametrize("overrides, expected", CASES, ids=[" ".join(o) for o, _ in CASES])
def test_a_bad_override_is_one_error_line_naming_the_field(compose_cfg, overrides, expected) -> None:
    _assert_one_line(_error_line(lambda: compose_cfg(*overrides)), expected)


def test_the_shipped_configs_are_valid(compose_cfg) -> None:
    # The table's errors come from the override, not from a base config that is already wrong.
    for base in BASES:
        assert _error_line(lambda: compose_cfg(*base)) is None, base


# -- fuzzing: junk at every leaf of every group option ------------------------------------------------------------

TRACE = REPO / "tests" / "data" / "trace_ok.jsonl"

# One composed config per option of every group (every scheduler, allocator, workload, runner, live, logger).
BASES: list[list[str]] = [
    [],
    ["scheduler=edf", "workload=synthetic", "logger=wandb", "live=web", "allocator=radix"],
    ["scheduler=mlfq", *SIM_ANALYTICAL, "allocator=prefix"],
    ["scheduler=sjf", "workload=trace", f"workload.path={TRACE}", "live=tui", "attention=torch"],
    ["scheduler=fair", "workload=bursty_slo", "allocator=contiguous"],
    ["scheduler=lpm", "workload=shared_prefix", "attention=cpu"],
    ["scheduler=sarathi", "runner=sim"],
    ["scheduler=priority", "model=default"],
    ["scheduler=random"],
    ["scheduler=prefill_first"],
    ["speculative=ngram"],
]

# Override values of the wrong type or impossible, in Hydra's override grammar.
JUNK = ["abc", "''", "-1", "0", "-0.5", "1.5", "1e400", "nan", "-inf", "[1,2]", "[]", "{a:1}", "null", "true",
        "maybe", "99999999999999999999", "'../../etc'"]


def _leaves(node, prefix: str = "") -> list[str]:
    keys = []
    for key in node:
        value = node._get_node(key)
        path = f"{prefix}{key}"
        if isinstance(value, DictConfig) and len(value):
            keys += _leaves(value, f"{path}.")
        else:  # a scalar, a list, or an empty mapping: one override replaces it whole
            keys.append(path)
    return keys


@functools.cache
def _composed(base: str) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=base.split())


# (base, leaf key, value), drawn as plain strings so that a failure prints only the three.
FUZZ_BASES = [" ".join(base) for base in BASES]


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_junk_at_any_leaf_is_valid_or_one_error_line_naming_it(data) -> None:
    base = _composed(data.draw(st.sampled_from(FUZZ_BASES), label="base"))
    key = data.draw(st.sampled_from(_leaves(base)), label="leaf")
    junk = data.draw(st.sampled_from(JUNK), label="value")
    override = f"{key}={junk}"

    def apply() -> DictConfig:
        # The step of Hydra's compose that merges a value override into the composed config (the group options
        # are already in `base`): the same parser and merge, without re-reading the YAML files each time.
        cfg = copy.deepcopy(base)
        ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides([override]), cfg)
        return cfg

    line = _error_line(apply)
    if line is not None:
        leaf = key.rsplit(".", 1)[-1]
        _assert_one_line(line, [])
        assert key in line or leaf in line, f"{override}: {line}"


# -- what cannot run is refused before the model and the kernels load ---------------------------------------------

@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading the model's weights or the C++ kernels raises: an error the engine could have given before
    them shows up as the test's expected error only if it came first."""

    def loaded(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} loaded before the error")
        return fail

    monkeypatch.setattr("nanovllm.engine.model_runner.load_model", loaded("the model"))
    monkeypatch.setattr("nanovllm.kernels.load", loaded("the kernels"))
    monkeypatch.setattr("nanovllm.models.llama.load_kernels", loaded("the kernels"))


NOT_LOADABLE = [
    (dict(scheduler="fcsf"), r"unknown policy 'fcsf'.*Did you mean 'fcfs'"),
    (dict(allocator={"name": "paged", "num_blocks": 4}), r"allocator='paged' does not take options \['num_blocks'\]"),
    (dict(allocator={"name": "radix", "eviction": "mru"}), r"eviction must be one of fifo, lfu, lru"),
    (dict(scheduler={"name": "sjf", "predictor": "psychic"}), r"predictor must be one of oracle"),
    (dict(attention="nope"), r"unknown attention backend 'nope'"),
    (dict(attention={"name": "cpu", "bogus": 1}), r"attention backend='cpu' does not take options \['bogus'\]"),
    (dict(kv_cache_memory=100), r"the KV cache budget \(100 bytes\) is smaller than one block"),
    (dict(max_model_len=10 ** 6), r"max_model_len must be <= the model's max_position_embeddings"),
]
if not torch.cuda.is_available():
    NOT_LOADABLE.append((dict(attention="flashinfer"), r"attention backend 'flashinfer' cannot run on cpu: .*CUDA"))


@pytest.mark.parametrize("options, message", NOT_LOADABLE, ids=[str(o) for o, _ in NOT_LOADABLE])
def test_the_engine_refuses_what_cannot_run_before_it_loads_anything(nothing_loads, options, message):
    from nanovllm import LLM

    with pytest.raises(ValueError, match=message):
        LLM(**options)


def test_the_spies_do_catch_a_load(nothing_loads):
    from nanovllm import LLM

    with pytest.raises(AssertionError, match="the model loaded before the error"):
        LLM(num_kv_blocks=8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="flashinfer may run here")
def test_the_command_line_refuses_flashinfer_on_cpu_before_the_model_loads(tmp_path):
    # The subprocess would write tmp_path/held on its first call of load_model (tests/startup_hold).
    from helpers import held_env

    proc = subprocess.run([sys.executable, "-m", "nanovllm.run", "attention=flashinfer", "progress=false",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                          env=held_env(tmp_path, "nanovllm.engine.model_runner:load_model"), timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: attention backend 'flashinfer' cannot run on cpu: FlashInfer's kernels need a CUDA "
                     "device (use attention=torch on CPU)"], proc.stderr[-3000:]
    assert not (tmp_path / "held").exists(), "the model started loading"
