"""Chat templates: a conversation's prompt token ids, as the model's tokenizer templates them. The engine
side owns this (``LLM.chat`` and ``validate`` use it); workloads reuse it."""

from __future__ import annotations

from typing import Any


def chat_token_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """A conversation's prompt ids through the tokenizer's chat template, ready for the assistant's turn
    (transformers 5 may return a BatchEncoding/dict instead of a list)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):  # a batch of one
        out = out[0]
    return [int(t) for t in out]
