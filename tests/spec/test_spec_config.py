"""The ``speculative`` Hydra group reaches ``EngineConfig.speculative``, checked before the model loads."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from nanovllm.harness.conf_schema import register_configs
from nanovllm.harness.run import check_config, config_dir


def _checked(*overrides: str, config_name: str = "config"):
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return check_config(compose(config_name=config_name, overrides=list(overrides)))


def test_speculation_is_off_by_default_and_the_ngram_option_sets_method_k_and_lookup():
    assert _checked().engine.speculative is None
    spec = _checked("speculative=ngram", "speculative.num_tokens=5", "speculative.prompt_lookup_max=3").engine.speculative
    assert spec == dict(method="ngram", num_speculative_tokens=5, prompt_lookup_max=3, prompt_lookup_min=1,
                        policy="fixed")


def test_the_speculation_policy_is_chosen_by_name_or_with_options_in_a_mapping():
    assert _checked("speculative=ngram", "speculative.policy=adaptive").engine.speculative["policy"] == "adaptive"
    spec = _checked("speculative=ngram", "speculative.policy={name:off_above_batch,max_batch:4}").engine.speculative
    assert spec["policy"] == dict(name="off_above_batch", max_batch=4)


@pytest.mark.parametrize("overrides, message", [
    (("speculative=ngram", "+speculative.bogus=1"), "does not take options"),
    (("speculative=ngram", "speculative.method=nope"), "speculative.method must be null .off. or a registered proposer .draft, layer_skip, ngram"),
    (("speculative=ngram", "speculative.num_tokens=0"), r"num_speculative_tokens \(num_tokens\) must be an integer >= 1"),
    (("speculative=ngram", "runner=sim"), "runner.acceptance: simulating speculative decoding needs an acceptance"),
    (("speculative=ngram", "runner=sim", "runner.acceptance=2"), r"runner.acceptance: a per-token acceptance rate"),
    (("speculative=ngram", "speculative.policy=nope"), "unknown speculation policy 'nope'"),
    (("speculative=ngram", "speculative.policy={name:off_above_batch,bogus:1}"), "does not take options"),
    (("speculative=ngram", "speculative.policy={name:off_above_batch,max_batch:-1}"), "max_batch must be"),
    (("speculative=layer_skip", "speculative.num_layers=0"), "num_layers must be null or an integer >= 1"),
    (("speculative=draft", "speculative.model=/nonexistent"), "expected a local HF directory"),
    (("speculative=draft", "speculative.quantization=fp4"), "quantization must be"),
])
def test_a_bad_speculative_setting_fails_before_the_model_loads(overrides, message):
    with pytest.raises(ValueError, match=message):
        _checked(*overrides)


@pytest.mark.parametrize("config_name", ["config", "serve"])
def test_the_model_proposers_groups_compose_for_run_and_serve(config_name):
    # python -m nanovllm.serve composes conf/serve.yaml, which takes every group of config.yaml, speculative too.
    assert _checked("speculative=draft", "speculative.num_tokens=4", config_name=config_name).engine.speculative == \
        dict(method="draft", num_speculative_tokens=4, model=None, quantization="auto", attention="auto",
             policy="fixed")
    spec = _checked("speculative=layer_skip", "speculative.num_layers=8", config_name=config_name).engine.speculative
    assert spec == dict(method="layer_skip", num_speculative_tokens=3, num_layers=8, attention="auto", policy="fixed")
