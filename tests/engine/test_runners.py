"""The runner seam: the built-in runners are registered by name, ``real`` means ``tp`` when the model is split,
unknown names list the registered ones, and a runner registered by a user (here a model-free one, as an HTTP
client of another server would be) is built by the engine and served by the harness like any other."""

from __future__ import annotations

import pytest
import torch

from nanovllm import RUNNERS, EngineConfig, LLMEngine, Runner, SamplingParams, register_runner
from nanovllm.config import head_dim_of, torch_dtype
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.runner import resolve_runner, runner_class
from nanovllm.engine.sim_runner import SimulatedRunner
from nanovllm.engine.tp.runner import TensorParallelRunner
from nanovllm.harness.runners import check_runner
from nanovllm.harness.serving import ServedEngine, WallClock
from nanovllm.harness.workload import WorkloadRequest

ANSWER = 5   # the one token the user's runner ever samples


def test_the_built_in_runners_are_registered_and_real_means_tp_when_split():
    assert RUNNERS.names() == ["real", "sim", "tp"]
    assert (RUNNERS.get("real"), RUNNERS.get("sim"), RUNNERS.get("tp")) == (ModelRunner, SimulatedRunner,
                                                                          TensorParallelRunner)
    assert ModelRunner.loads_model and TensorParallelRunner.loads_model and not SimulatedRunner.loads_model
    assert resolve_runner("real", EngineConfig()) == "real"
    assert resolve_runner("real", EngineConfig(tensor_parallel_size=2)) == "tp"
    assert resolve_runner({"name": "real"}, EngineConfig(tensor_parallel_size=2)) == {"name": "tp"}
    with pytest.raises(ValueError, match="runner 'tp' splits the model over tensor_parallel_size ranks, which is 1"):
        resolve_runner("tp", EngineConfig())


def test_an_unknown_runner_lists_the_registered_ones():
    with pytest.raises(KeyError, match=r"unknown runner 'nope'\. Registered runner names: real, sim, tp"):
        runner_class("nope")
    with pytest.raises(ValueError, match=r"runner.name must be one of http, real, sim, tp, got 'nope'"):
        check_runner({"name": "nope"}, None)
    with pytest.raises(ValueError, match=r"runner: unknown key\(s\) url for runner=real; allowed: name"):
        check_runner({"name": "real", "url": "http://localhost:8000"}, None)


@pytest.fixture
def constant_runner(monkeypatch):
    """A model-free runner registered as ``constant`` for the test only: every sampled token is ``ANSWER``."""
    RUNNERS.names()   # the built-ins register first, so the copy below holds them
    monkeypatch.setattr(RUNNERS, "_entries", dict(RUNNERS._entries))   # the registration ends with the test

    @register_runner("constant")
    class ConstantRunner(Runner):
        loads_model = False

        def __init__(self, context, answer: int = ANSWER) -> None:
            hf = context.hf_config
            self.device, self.dtype = torch.device(context.config.device), torch_dtype(context.config.dtype)
            self.num_layers, self.num_heads = hf.num_hidden_layers, hf.num_attention_heads
            self.num_kv_heads, self.head_dim = hf.num_key_value_heads, head_dim_of(hf)
            self.answer = answer
            self.steps = 0

        def init_kv_cache(self, num_blocks, block_size, backend, graphs=None) -> None:
            self.num_blocks = num_blocks

        def execute(self, scheduled):
            self.steps += 1
            tokens = [self.answer if r.num_computed_tokens + n == r.num_tokens else None for r, n in scheduled]
            return tokens, [None] * len(tokens)

    return ConstantRunner


def test_a_registered_runner_is_built_by_the_engine_and_decides_every_token(constant_runner):
    engine = LLMEngine(EngineConfig(num_kv_blocks=16, max_model_len=256), attention="torch",
                       runner={"name": "constant", "answer": 9})
    assert isinstance(engine.runner, constant_runner) and engine.runner.num_blocks == 16
    assert engine.warmup_steps == 0 and engine.clock is engine.runner.clock   # no model: no warm-up
    requests = [engine.make_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)) for _ in range(2)]
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in requests] == [[9, 9, 9], [9, 9, 9]] and engine.runner.steps == 3


def test_the_harness_serves_a_registered_runner_as_any_other(constant_runner):
    check_runner({"name": "constant", "answer": 7}, None)   # its options are its constructor's
    served = ServedEngine.build(EngineConfig(num_kv_blocks=16, max_model_len=256), {"name": "constant"},
                                attention="torch")
    assert isinstance(served.clock, WallClock) and served.cost.num_layers == served.engine.hf_config.num_hidden_layers
    workload = [WorkloadRequest(arrival_time=0.0, prompt=[1, 2, 3, 4], max_tokens=2, ignore_eos=True)
                for _ in range(3)]
    result = served.serve(workload, progress=False)
    assert result.summary["completed"] == 3 and result.output_token_ids == {str(i): [ANSWER] * 2 for i in range(3)}
    assert "machine" in result.summary   # a real-time run records the machine it ran on
