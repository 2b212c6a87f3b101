"""The model seam: the loader runs the class registered (``MODELS``) under the checkpoint's ``architectures`` name,
a plugin file registers a new one, and an unregistered name is an error naming the field and what is registered."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from helpers import save_tiny_model

from nanovllm import LLM, MODELS, SamplingParams
from nanovllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM
from nanovllm.models.loader import model_class, resolve_model

PLUGIN = '''
from nanovllm import register_model
from nanovllm.models.llama import LlamaForCausalLM


@register_model("PluginLlamaForCausalLM")
class PluginLlama(LlamaForCausalLM):
    """Llama's layers under a new architecture name, counting the steps it computes logits for."""

    logits_calls = 0

    def compute_logits(self, hidden):
        type(self).logits_calls += 1
        return super().compute_logits(hidden)
'''
PROMPTS = [[1, 500, 600, 700], list(range(3, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tiny_checkpoint(path: Path, architecture: str | None) -> Path:
    """A tiny random Llama checkpoint whose config.json names ``architecture`` (None: no such field)."""
    save_tiny_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, {}, path,
                    resolve_model(None, weights=False))
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("architectures", None)
    if architecture is not None:
        config["architectures"] = [architecture]
    config_file.write_text(json.dumps(config))
    return path


def test_a_plugin_file_registers_an_architecture_that_the_engine_then_runs(tmp_path):
    plugin = tmp_path / "my_model.py"
    plugin.write_text(textwrap.dedent(PLUGIN))
    ours = _tiny_checkpoint(tmp_path / "plugin", "PluginLlamaForCausalLM")
    llama = tmp_path / "llama"
    llama.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):  # the very same weights
        (llama / name).write_bytes((ours / name).read_bytes())
    config = json.loads((ours / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))

    llm = LLM(model=str(ours), plugins=[str(plugin)], num_kv_blocks=32, block_size=8)
    model = llm.engine.runner.model
    assert type(model).__name__ == "PluginLlama" and MODELS.get("PluginLlamaForCausalLM") is type(model)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert type(model).logits_calls > 0
    reference = LLM(model=str(llama), num_kv_blocks=32, block_size=8)
    assert type(reference.engine.runner.model) is LlamaForCausalLM
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_an_unregistered_architecture_names_the_field_and_the_registered_ones(tmp_path):
    path = _tiny_checkpoint(tmp_path, "NoSuchModelForCausalLM")
    with pytest.raises(ValueError, match=r"architectures=\['NoSuchModelForCausalLM'\].*Registered model "
                                         r"architectures: .*LlamaForCausalLM.*@register_model"):
        LLM(model=str(path), num_kv_blocks=32, block_size=8)


def test_a_config_without_architectures_is_read_by_its_model_type():
    # transformers' GGUF conversion (the default model's cached directory) writes no architectures field.
    assert model_class(transformers.LlamaConfig()) is LlamaForCausalLM
    assert model_class(transformers.Qwen3Config()) is Qwen3ForCausalLM
    assert model_class(transformers.LlamaConfig(architectures=["Nope", "MistralForCausalLM"])) is MistralForCausalLM
    with pytest.raises(ValueError, match="no architectures, model_type='gpt2'"):
        model_class(transformers.GPT2Config())


def test_every_registered_architecture_is_a_causal_lm_the_loader_can_build():
    from nanovllm.models.base import CausalLM

    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"} <= set(MODELS.names())
    for name in MODELS.names():
        assert issubclass(MODELS.get(name), CausalLM)


def test_a_sliding_window_shorter_than_the_positions_is_refused():
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    with torch.device("meta"):
        with pytest.raises(ValueError, match="sliding_window=16"):
            MistralForCausalLM(transformers.MistralConfig(**small, sliding_window=16), max_positions=512)
        MistralForCausalLM(transformers.MistralConfig(**small, sliding_window=None), max_positions=512)
