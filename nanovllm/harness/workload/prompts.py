"""Prompt material: the shipped chat dataset, readable text cut to an exact token length, random token ids,
shared prefixes, and synthetic prompts built from them."""

from __future__ import annotations

import functools
import importlib.resources
import json
from typing import Any, Callable

import numpy as np

from nanovllm.harness.workload.distributions import _rng


def load_chat_prompts() -> list[list[dict]]:
    """The shipped chat dataset: a list of conversations, each a list of ``{"role", "content"}`` messages."""
    text = (importlib.resources.files("nanovllm") / "data" / "chat_prompts.json").read_text(encoding="utf-8")
    return [item["messages"] for item in json.loads(text)]


@functools.lru_cache(maxsize=1)
def _text_words() -> tuple[str, ...]:
    """Every word of the chat dataset, in order: the raw material of ``prompt_kind="text"`` prompts."""
    return tuple(w for conv in load_chat_prompts() for m in conv for w in m["content"].split())


def _normal_token_ids(tokenizer: Any) -> np.ndarray:
    """Vocabulary ids that are not special tokens (a random prompt must not contain BOS/EOS/pad)."""
    return np.setdiff1d(np.arange(tokenizer.vocab_size), np.asarray(tokenizer.all_special_ids, dtype=np.int64))


def _random_tokens(ids: np.ndarray, n: int, rng: np.random.Generator) -> list[int]:
    return ids[rng.integers(0, len(ids), size=n)].tolist()


def _text_tokens(tokenizer: Any, n: int, rng: np.random.Generator) -> list[int]:
    """Exactly ``n`` token ids of readable text: words from a random point of the dataset, cut to length."""
    words = _text_words()
    start = int(rng.integers(len(words)))
    count = n  # a word is at least one token nearly always, so n words usually suffice; double if not
    while True:
        text = " ".join(words[(start + i) % len(words)] for i in range(count))
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= n:
            return list(ids[:n])
        count *= 2


def _token_maker(prompt_kind: str, tokenizer: Any) -> Callable[[int, np.random.Generator], list[int]]:
    """``make(n, rng)``: ``n`` token ids of the ``prompt_kind`` (``"random"`` ids or readable ``"text"``)."""
    if prompt_kind == "text":
        return functools.partial(_text_tokens, tokenizer)
    return functools.partial(_random_tokens, _normal_token_ids(tokenizer))


def _synthetic_prompts(cfg: Any, tokenizer: Any, input_lens: np.ndarray) -> list[list[int]]:
    """Each prompt: an optional shared prefix (its group's) + its own suffix of the sampled input length."""
    rng = _rng(cfg.seed, "prompts")
    make = _token_maker(cfg.prompt_kind, tokenizer)
    if cfg.num_prefix_groups == 0:
        return [make(int(n), rng) for n in input_lens]
    prefixes = _shared_prefixes(make, cfg.seed, cfg.num_prefix_groups, cfg.prefix_len, len(input_lens))
    return [prefix + make(int(n), rng) for prefix, n in zip(prefixes, input_lens)]


def _shared_prefixes(make: Callable[[int, np.random.Generator], list[int]], seed: int, num_groups: int,
                     length: int, n: int) -> list[list[int]]:
    """The shared prefix of each of ``n`` prompts (or sessions): ``num_groups`` prefixes of ``length`` tokens,
    one picked per prompt (the ``prefix`` stream). Equal groups give the very same list object."""
    prefix_rng = _rng(seed, "prefix")
    prefixes = [make(length, prefix_rng) for _ in range(num_groups)]
    # Groups are picked at random (seeded) rather than round robin so their reuse distances vary, as in real
    # traffic; strict round robin is the worst case for an LRU prefix cache.
    groups = prefix_rng.integers(0, num_groups, size=n)
    return [prefixes[g] for g in groups]
