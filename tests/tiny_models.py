"""Small random-weight HF models saved as local model directories, for tests that need a real model of a given
architecture (test_models.py) or many cheap engine steps (test_soak.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, vocab_size=49152, tie_word_embeddings=False)


def save_tiny_model(config_cls, model_cls, extra: dict, path: Path, tokenizer_dir: Path, seed: int = 0):
    """Save a ``SMALL`` model of ``model_cls`` (weights scaled up so that logits are decisive and attention is not
    flat) with the tokenizer files of ``tokenizer_dir`` to ``path``; return the transformers model."""
    torch.manual_seed(seed)
    config = config_cls(**SMALL, **extra, bos_token_id=1, eos_token_id=2)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # borrow the default model's tokenizer
        shutil.copy(Path(tokenizer_dir) / name, Path(path) / name)
    return model
