"""The fast path's C++ decoder stack (``nanovllm/csrc/decoder_stack.cpp``) against the Python loop over the same
fused kernels: the same tokens and bitwise the same logprobs on every fast CPU path it serves (quantized weights,
dense bf16 and float32, 8-bit KV caches, biases), in steps that mix prefill chunks with decodes; and the Python
loop wherever the stack does not apply (q/k norm, the SDPA group, a profiler recording, a subclassed backend)."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import save_tiny_model

from nanovllm import LLM, SamplingParams
from nanovllm.attention.cpu_backend import CpuAttention
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.profile import layer_loop

PROMPTS = [list(range(100, 160)), list(range(300, 317)), [42] * 9, list(range(7, 40))]
# Small batches of tokens per step: prompts are prefilled in chunks beside other requests' decodes.
STEP = dict(max_num_batched_tokens=24, num_kv_blocks=128, max_model_len=512)


def _outputs(llm: LLM, use_stack: bool, counter: list[int]) -> list[tuple[list[int], list]]:
    model = llm.engine.runner.model
    model.use_decoder_stack = use_stack
    real = LlamaForCausalLM.decoder_stack.__get__(model)

    def counted():
        counter.append(1)
        return real()

    model.decoder_stack = counted  # the forward calls it exactly when it runs the stack
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3),
                            use_tqdm=False)
    finally:
        del model.decoder_stack
        model.use_decoder_stack = True
    return [(o.token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.logprobs])
            for o in outs]


def _assert_stack_matches_python_loop(llm: LLM) -> None:
    assert llm.engine.runner.model.decoder_stack() is not None
    stacked, python_loop = [], []
    with_stack = _outputs(llm, True, stacked)
    without = _outputs(llm, False, python_loop)
    assert stacked and not python_loop  # the stack ran every step in the first run, never in the second
    assert with_stack == without
    assert len(set(with_stack[0][0])) > 1  # not a degenerate constant output


PATHS = {
    "gguf-q4": dict(quantization="gguf"),
    "int8-weights-fp8-kv": dict(dtype="float32", quantization="int8", kv_cache_dtype="fp8_e4m3"),
    "bf16-int8-kv": dict(dtype="bfloat16", kv_cache_dtype="int8"),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_decoder_stack_gives_the_python_loops_tokens_and_logprobs(path):
    _assert_stack_matches_python_loop(LLM(**PATHS[path], **STEP))


ARCHITECTURES = {
    "llama3-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2-qkv-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, llm):
    paths = {}
    for name, (config_cls, model_cls, extra) in {**ARCHITECTURES, "qwen3": (
            transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32))}.items():
        paths[name] = tmp_path_factory.mktemp(name)
        save_tiny_model(config_cls, model_cls, extra, paths[name], llm.engine.model_dir)
    return paths


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_decoder_stack_serves_float32_fused_layers_with_biases_and_rope_scaling(arch, tiny_models):
    _assert_stack_matches_python_loop(LLM(model=str(tiny_models[arch]), fuse_projections=True, **STEP))


def test_q_k_norm_layers_keep_the_python_loop(tiny_models):
    llm = LLM(model=str(tiny_models["qwen3"]), fuse_projections=True, **STEP)
    assert llm.engine.runner.model.decoder_stack() is None
    assert layer_loop(llm.engine.runner.model).startswith("the Python loop (a layer the C++ stack does not run")
    assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)[0].token_ids) == 4


def test_steps_the_stack_cannot_run_fall_back_to_the_python_loop():
    engine = LLM(quantization="gguf", **STEP)
    model, backend = engine.engine.runner.model, engine.engine.runner.backend
    kernels = model.kernels
    assert layer_loop(model).startswith("one C++ loop")
    assert isinstance(backend, CpuAttention) and backend.kernel_step(kernels) is not None
    # Another kernel build than the model's, a subclass with its own forward: the backend says no.
    assert backend.kernel_step(object()) is None

    class Traced(CpuAttention):
        def forward(self, layer, q, k, v):
            return super().forward(layer, q, k, v)

    traced = Traced.__new__(Traced)
    traced.__dict__.update(backend.__dict__)
    assert traced.kernel_step(kernels) is None
    # A profiler recording sees every kernel as its own op: the Python loop runs.
    with torch.profiler.profile():
        assert model._stack_step(backend) is None
    assert model._stack_step(backend) is not None


def test_a_long_chunk_on_sdpa_keeps_the_python_loop():
    engine = LLM(quantization="gguf", attention={"name": "cpu", "sdpa_min_query": 8}, **STEP)
    backend = engine.engine.runner.backend
    calls: list[int] = []
    real = backend.kernel_step

    def spy(kernels):
        step = real(kernels)
        calls.append(step is None)
        return step

    backend.kernel_step = spy
    outs = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 3]
    assert True in calls and False in calls  # prefill chunks on SDPA fell back; pure decode steps stacked


def test_the_reference_path_runs_the_python_loop(llm):
    assert layer_loop(llm.engine.runner.model).startswith("the Python loop (no fused CPU kernels")
