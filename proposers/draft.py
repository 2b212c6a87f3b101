"""Draft-model speculation, vLLM's ``method="draft_model"``: a separate, smaller or cheaper model sharing the
target's tokenizer decodes K tokens greedily for each request; the target verifies them in one forward.

With no ``model`` the draft is the default model's own 4-bit GGUF file run from its blocks
(``quantization='gguf'``): it drafts for the same model's float32 or bf16 path with nothing to download, and
agrees with it on most tokens. The draft keeps a paged KV cache of its own and rolls it back to what the target
accepted (``nanovllm.engine.draft_model``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from nanovllm import DraftModel, Proposer, ProposerContext, Request, register_proposer


@register_proposer("draft")
class DraftProposer(Proposer):
    """``model``: a local HF directory or ``.gguf`` file (None: the default model's GGUF); ``quantization``:
    ``'gguf'`` (the file's own 4-bit blocks, on CPU) or None (dense weights in the engine's dtype, on its
    device); ``'auto'`` (the default) is ``'gguf'`` for a ``.gguf`` file or no model, None for a directory.
    ``attention``: the draft's attention backend (``auto``: the device's default)."""

    feeds_a_model = True

    def __init__(self, context: ProposerContext, model: str | None = None, quantization: str | None = "auto",
                 attention: Any = "auto") -> None:
        super().__init__(context)
        if model is not None:
            path = Path(str(model)).expanduser()
            if not ((path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".gguf")):
                raise ValueError(f"speculative.model={model!r}: expected a local HF directory with config.json or a "
                                 ".gguf file")
        if quantization == "auto":
            quantization = "gguf" if model is None or str(model).endswith(".gguf") else None
        if quantization not in (None, "gguf", "int8"):
            raise ValueError(f"speculative.quantization must be 'auto', 'gguf', 'int8' or null, got {quantization!r}")
        self.model_path, self.quantization, self.attention = model, quantization, attention
        self.draft: DraftModel | None = None
        if context.hf_config is not None:   # the engine's instance (not the config check's): load now, not mid-step
            config = context.config
            self.draft = DraftModel.load(model, quantization, context.hf_config, config.dtype, config.device,
                                         attention)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        if self.draft is None:   # the config check's instance has no model: it proposes nothing
            return [[] for _ in requests]
        proposals = self.draft.propose(requests, num_tokens)
        # A draft vocabulary padded past the target's could name ids the target does not have: cut there.
        vocab = self.context.vocab_size
        return [next((tokens[:j] for j, t in enumerate(tokens) if t >= vocab), tokens) for tokens in proposals]

    @property
    def num_fed_tokens(self) -> int:
        return self.draft.num_fed_tokens if self.draft is not None else 0

    def on_finish(self, request: Request) -> None:
        if self.draft is not None:
            self.draft.forget(request)
