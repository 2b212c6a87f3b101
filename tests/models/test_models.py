"""Our Llama-family implementation against transformers on small random-weight models of each supported
architecture (Llama with Llama-3 rope scaling, Qwen2 with qkv bias, Qwen3 with q/k norm, Mistral), loaded from a local HF
directory of safetensors: greedy float32 tokens must be identical."""

from __future__ import annotations

import pytest
import transformers
from helpers import save_tiny_model

from nanovllm import LLM, SamplingParams
from nanovllm.validate import reference_greedy

ARCHITECTURES = {
    "llama3-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
    # Mistral without a sliding window (v0.2 on): Llama's layers under MistralForCausalLM.
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny_model_dir(request, tmp_path_factory, llm):
    config_cls, model_cls, extra = ARCHITECTURES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return path, save_tiny_model(config_cls, model_cls, extra, path, llm.engine.model_dir)


def test_architecture_matches_transformers(tiny_model_dir):
    path, reference = tiny_model_dir
    prompts = [[1, 500, 600, 700], list(range(3, 90)), [42] * 20]
    ours = LLM(model=str(path), num_kv_blocks=64, block_size=8).generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in ours] == reference_greedy(reference, prompts, 12, ignore_eos=True)
    assert len(set(ours[1].token_ids)) > 1  # not a degenerate constant output


def test_a_model_path_that_is_not_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(model=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="expected a local HF directory"):
        LLM(model=str(tmp_path / "missing"))
