"""The speculation seam. A ``Proposer`` guesses the next few tokens of a decoding request; the engine verifies
every guess with one forward pass of the target model over the paged KV cache and keeps only what the target
itself would have produced, so a proposer can make decoding faster but never changes the answer (greedy: the
same tokens; sampling: the same distribution).

A minimal proposer overrides ``propose_one``::

    @register_proposer("repeat_last")
    class RepeatLast(Proposer):
        def propose_one(self, request, num_tokens):
            return [request.token_ids[-1]] * num_tokens

and is chosen with ``LLM(speculative=dict(method="repeat_last", num_speculative_tokens=3))`` or, on the command
line, ``speculative=ngram speculative.method=repeat_last`` (any group file, ``method`` overridden). Options
beyond ``method`` and ``num_speculative_tokens`` go to the constructor after the engine's ``ProposerContext``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from nanovllm.config import EngineConfig
from nanovllm.registry import Registry
from nanovllm.request import Request


class ProposerError(RuntimeError):
    """A proposer raised or returned something the engine cannot verify (too many tokens, ids outside the
    vocabulary), or a speculation policy raised or returned a length outside [0, K]."""


@dataclasses.dataclass(frozen=True)
class ProposerContext:
    """What the engine hands a proposer it builds: its config, the target model's HF config and directory, the
    vocabulary size (every proposed id must be below it) and the target's runner (for proposers that share the
    target's weights, e.g. self-speculation)."""

    config: EngineConfig
    hf_config: Any
    model_dir: Path | None
    vocab_size: int
    runner: Any = None


class Proposer:
    """Base proposer: proposes nothing until a subclass says how.

    The constructor takes the ``ProposerContext`` and the options, checks the options and stays cheap: a
    throwaway instance (its context without the model: ``hf_config``, ``model_dir`` and ``runner`` None,
    ``vocab_size`` 0) is built to check a config before the model loads, as policies are. A proposer that runs
    a model of its own (``draft``, ``layer_skip``) loads or cuts it when built with the target's ``hf_config``
    (the engine's instance, so no step pays for it), and the throwaway instance proposes nothing.

    When the engine calls it: ``propose`` once per engine step, before the scheduler plans the step, with the
    running requests that will decode (their newest token is the only one not yet in the cache) and how many
    tokens each may get; ``on_finish`` when a request ends (finished, failed or aborted), to drop per-request
    state. Methods receive live ``Request`` objects and must only read them.
    """

    registered_name: str = "custom"
    # Whether proposing runs a model of the proposer's own that is fed each request's tokens (``draft``,
    # ``layer_skip``): a simulated run then counts the tokens it would feed (``num_fed_tokens``) as the real
    # one does, so the proposer's catch-up on a new request's prompt is priced.
    feeds_a_model: bool = False

    def __init__(self, context: ProposerContext) -> None:
        self.context = context

    @property
    def num_fed_tokens(self) -> int:
        """Tokens this proposer's own model has run forward so far (a counter): each request's tokens it had not
        seen (a new request's whole context, then the target's newest token and accepted proposals it had not
        fed), plus its own proposals fed back to propose the next. The engine records each step's increase
        (``spec_proposer_fed_tokens``). Default: 0 (no model)."""
        return 0

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """Per request, up to ``num_tokens[i]`` (>= 1) token ids guessed to follow ``requests[i].token_ids``
        (fewer, or none, is fine: a request without proposals decodes one token as usual). Called once per step
        with every decoding request, so a proposer that runs a model can batch them; the default asks
        ``propose_one`` of each request."""
        return [self.propose_one(request, k) for request, k in zip(requests, num_tokens)]

    def propose_one(self, request: Request, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` ids guessed to follow ``request.token_ids`` (what ``propose`` asks per request).
        A proposer overrides this or ``propose``; the base proposes nothing, so each request decodes one token
        as usual."""
        return []

    def on_finish(self, request: Request) -> None:
        """``request`` ended; forget whatever was kept for it."""


PROPOSERS: Registry[Proposer] = Registry("proposer", base=Proposer, builtin_packages=("proposers",),
                                         engine_args=("context",))


def register_proposer(name: str):
    """Class decorator registering a ``Proposer`` subclass under ``name`` (``speculative.method=<name>``)."""
    return PROPOSERS.register(name)


def check_speculative(config: EngineConfig) -> None:
    """Raise ``ValueError`` for ``config.speculative`` naming an unknown proposer or an option or option value
    its constructor refuses, before any model loads (a throwaway instance is built, without the model)."""
    if config.speculative is None:
        return
    spec = PROPOSERS.check(proposer_spec(config.speculative), "speculative")
    PROPOSERS.build(spec, ProposerContext(config, hf_config=None, model_dir=None, vocab_size=0))


def proposer_spec(speculative: dict[str, Any]) -> dict[str, Any]:
    """The registry spec ``{"name": method, **options}`` of an ``EngineConfig.speculative`` mapping (its
    ``num_speculative_tokens`` is the engine's and its ``policy`` the speculation policy's, not the proposer's)."""
    options = {k: v for k, v in speculative.items() if k not in ("method", "num_speculative_tokens", "policy")}
    return {"name": speculative["method"], **options}
