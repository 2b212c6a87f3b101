"""The speculation-policy seam. A ``SpeculationPolicy`` decides, per request and per step, how many tokens the
proposer may guess (0: this request decodes one token as usual). The proposer (``nanovllm.proposer``) decides
*what* to guess; the policy decides *how much*, from the request, the load and what speculation has earned so far.

A minimal policy overrides ``num_speculative_tokens``::

    @register_spec_policy("short_when_busy")
    class ShortWhenBusy(SpeculationPolicy):
        def num_speculative_tokens(self, request, state):
            return 1 if state.num_running > 4 else state.max_num_tokens

and is chosen with ``LLM(speculative=dict(method="ngram", num_speculative_tokens=3, policy="short_when_busy"))``
or, on the command line, ``speculative=ngram speculative.policy=short_when_busy``; options go in a mapping,
``policy=dict(name="off_above_batch", max_batch=4)`` (Hydra: ``speculative.policy='{name:off_above_batch,
max_batch:4}'``). Without ``policy`` the engine uses ``fixed``: every decoding request may get ``K`` tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from nanovllm.registry import Registry
from nanovllm.request import Request


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The engine's measured cost of a decode step: ``fixed + per_token * n`` seconds for a step that computes
    ``n`` tokens (one per decoding request plus the proposals verified), fitted to recent decode-only steps."""

    fixed: float
    per_token: float

    def seconds(self, num_tokens: float) -> float:
        """The predicted duration of a decode step computing ``num_tokens`` tokens."""
        return self.fixed + self.per_token * num_tokens


@dataclasses.dataclass(frozen=True)
class SpeculationState:
    """What the engine knows when it plans a step's proposals, handed to the policy for each request.

    ``num_running``: requests in the running batch as the step is planned (decoding or still prefilling);
    ``num_decoding``: of those, the ones that decode this step and may get proposals; ``max_num_tokens``: K, the
    config's ``num_speculative_tokens`` (the most the policy may return); ``step_cost``: the cost of a decode
    step fitted to this engine's own measured steps, None until enough were measured."""

    num_running: int
    num_decoding: int
    max_num_tokens: int
    step_cost: StepCost | None = None


class SpeculationPolicy:
    """Base policy: always the most allowed (``fixed`` is this, by name).

    When the engine calls it: ``num_speculative_tokens`` once per step for each running request that decodes
    and may get proposals, before the proposer is asked (the engine then caps the answer so that no accepted
    run passes the request's ``max_tokens`` or the model's length); ``on_finish`` when a request ends, to drop
    per-request state. The request's ``num_drafts``, ``num_draft_tokens`` and ``num_accepted_tokens`` say what
    its proposals earned so far. Methods receive live ``Request`` objects and must only read them. The
    constructor takes only the policy's options and stays cheap (a throwaway instance checks a config).
    """

    registered_name: str = "custom"

    def num_speculative_tokens(self, request: Request, state: SpeculationState) -> int:
        """How many tokens ``request`` may have proposed this step: an int in [0, ``state.max_num_tokens``]."""
        return state.max_num_tokens

    def on_finish(self, request: Request) -> None:
        """``request`` ended; forget whatever was kept for it."""


SPEC_POLICIES: Registry[SpeculationPolicy] = Registry("speculation policy", base=SpeculationPolicy,
                                                     builtin_packages=("spec_policies",))


def register_spec_policy(name: str):
    """Class decorator registering a ``SpeculationPolicy`` subclass under ``name`` (``speculative.policy=<name>``)."""
    return SPEC_POLICIES.register(name)


DEFAULT_SPEC_POLICY = "fixed"


def spec_policy_spec(speculative: Mapping[str, Any]) -> Any:
    """The registry spec of ``EngineConfig.speculative``'s ``policy``: a name, ``{"name": ..., **options}`` or
    an instance; ``fixed`` when it has none."""
    policy = speculative.get("policy")
    return DEFAULT_SPEC_POLICY if policy is None else policy


def check_spec_policy(speculative: Mapping[str, Any] | None) -> None:
    """Raise ``ValueError`` for a ``speculative.policy`` naming an unknown policy or options its constructor
    refuses, before any model loads (a throwaway instance is built)."""
    if speculative is None:
        return
    SPEC_POLICIES.build(SPEC_POLICIES.check(spec_policy_spec(speculative), "speculative.policy"))
