"""Self-speculation by early exit (LayerSkip, Draft & Verify): the target's own first ``num_layers`` decoder
layers, then its final norm and LM head, propose K tokens greedily; the whole model verifies them. No second
model and no extra weights (the early layers are the target's, shared); the draft keeps its own paged KV cache
of those layers (``nanovllm.engine.draft_model``). A model not trained for early exit agrees with its early
layers less often than a trained one; ``num_layers`` trades draft cost against acceptance.
"""

from __future__ import annotations

from typing import Any, Sequence

from nanovllm import DraftModel, Proposer, ProposerContext, Request, register_proposer


@register_proposer("layer_skip")
class LayerSkipProposer(Proposer):
    """``num_layers``: the early layers that propose (None: half the target's layers); ``attention``: the
    draft's attention backend (``auto``: the device's default). Needs the real runner (the model in this
    process)."""

    feeds_a_model = True

    def __init__(self, context: ProposerContext, num_layers: int | None = None, attention: Any = "auto") -> None:
        super().__init__(context)
        if num_layers is not None and (not isinstance(num_layers, int) or isinstance(num_layers, bool)
                                       or num_layers < 1):
            raise ValueError(f"speculative.num_layers must be null or an integer >= 1, got {num_layers!r}")
        self.draft: DraftModel | None = None
        if context.hf_config is not None:   # the engine's instance: cut the target's layers now
            runner = context.runner
            model = getattr(runner, "model", None)
            if model is None:
                raise ValueError(f"speculative=layer_skip runs the target's own layers: it needs a runner holding "
                                 f"the model in this process (runner=real), not {type(runner).__name__}")
            total = context.hf_config.num_hidden_layers
            self.draft = DraftModel.first_layers(model, context.hf_config, num_layers or max(1, total // 2),
                                                 runner.dtype, runner.device, attention)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        if self.draft is None:   # the config check's instance has no model: it proposes nothing
            return [[] for _ in requests]
        return self.draft.propose(requests, num_tokens)

    @property
    def num_fed_tokens(self) -> int:
        return self.draft.num_fed_tokens if self.draft is not None else 0

    def on_finish(self, request: Request) -> None:
        if self.draft is not None:
            self.draft.forget(request)
