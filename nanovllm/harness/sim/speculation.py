"""Simulated speculative decoding: what a step with proposals costs, and how many proposals are accepted.

The engine runs its own speculation policy, scheduler budgets and counters on the simulated runner
(``nanovllm.engine.sim_runner``: ``SimulatedProposer``, ``AcceptanceModel``); this module supplies the two things
that are simulated.

**Price** (``SpeculativeStepTime``, wrapping the run's step-time model). The verify forward is a forward over 1+k
query tokens per request: ``verify_features`` counts a step's proposals as prompt-like rows (through the linears,
each with its own row of logits; their attention pairs and context are in the features already), which every
step-time model prices as tokens. The proposer's own work is added (``ProposerCost``):

* ``calibrated``: the profile's ``speculation`` section, fitted by ``calibrate`` on real runs with that proposer
  (non-negative coefficients on ``SPEC_COST_FEATURES``: per draft forward, per proposed token, per verified
  request, per token fed to the draft model; an ``ngram`` lookup is a small CPU cost, a ``draft`` model K
  forwards over the batch, the first of which also catches up on each request's tokens it has not seen: a new
  request's whole prompt);
* ``analytical`` / ``profiled``: ``draft`` = K forwards of the draft model (its own cost model, the default
  model's GGUF blocks when no ``model`` is given) over the requests that propose, ``layer_skip`` = K forwards of
  ``num_layers / L`` of the target, both from the analytical roofline on ``hardware``; ``ngram`` costs nothing;
* ``token_cost``: proposals are tokens; the proposer costs nothing.

**Acceptance** (``runner.acceptance``, an ``AcceptanceModel``), per request and seeded (``runner.acceptance_seed``,
with the request id, so a request's draws do not depend on the others):

* a number in [0, 1]: every request proposes whenever allowed, and a proposal is accepted at that rate per token
  (each position continues the accepted run with one probability ``p``, ``RequestProfile``);
* ``fitted``: each request draws one real request's profile (``runner.acceptance_run``, a real run with the same
  proposer) from that run's records, weighted by its decode steps: how often it had a proposal when asked, how
  long its proposals were, and its acceptance rate;
* ``replay``: each request takes the profile of the request with the same id in that run (the same workload
  and seed: the run's own requests).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any, Mapping, Sequence

from nanovllm.engine.sim_runner import SPEC_FEATURES, AcceptanceModel
from nanovllm.harness.sim.hardware import Hardware
from nanovllm.harness.sim.step_time import AnalyticalStepTime, StepTimeModel
from nanovllm.request import Request
from nanovllm.serving.monitor import ModelCost
from nanovllm.serving.records import read_config, read_run

# What the proposer's own cost is fitted on (a calibrated profile's ``speculation.coefficients``): the draft
# model's forwards (the most proposed for one request in the step), the tokens proposed, the requests verified,
# and the tokens the draft model was fed (a new request's whole context the first time it proposes).
SPEC_COST_FEATURES = ("spec_decode_max_proposed", "spec_decode_num_draft_tokens", "spec_decode_num_drafts",
                      "spec_proposer_fed_tokens")
ACCEPTANCE_MODELS = ("fitted", "replay")


def spec_features(step: Mapping[str, Any]) -> dict[str, Any]:
    """``step`` (a real step record or a simulated batch's features) with ``SPEC_FEATURES`` filled in: a record
    carries ``spec_decode_max_proposed`` as the length of its per-position counts."""
    out = dict(step)
    out.setdefault("spec_decode_num_drafts", 0)
    out.setdefault("spec_decode_num_draft_tokens", 0)
    out.setdefault("spec_decode_max_proposed", len(step.get("spec_decode_num_accepted_tokens_per_pos") or ()))
    out.setdefault("spec_proposer_fed_tokens", 0)   # runs recorded before the field, or without a draft model
    return out


def verify_features(features: Mapping[str, Any]) -> dict[str, Any]:
    """The features a step-time model prices a step with proposals by: each proposed token becomes a prompt-like
    row (``num_prefill_tokens``; out of ``num_decode_tokens``, so the tokens the step computes stay the same)
    that also computes a row of logits (``num_sampled``), as the verify forward does. A step without proposals
    is unchanged."""
    proposed = int(features.get("spec_decode_num_draft_tokens") or 0)
    if not proposed:
        return dict(features)
    out = dict(features)
    out["num_prefill_tokens"] = features["num_prefill_tokens"] + proposed
    out["num_decode_tokens"] = features["num_decode_tokens"] - proposed
    out["num_sampled"] = features["num_sampled"] + proposed
    return out


# -- the proposer's cost -------------------------------------------------------------------------------------------

class ProposerCost:
    """Seconds the proposer adds to a step with these (``spec_features``) features; the base costs nothing."""

    def seconds(self, features: Mapping[str, Any]) -> float:
        return 0.0

    def describe(self) -> str:
        return "free"


@dataclasses.dataclass
class CalibratedProposerCost(ProposerCost):
    """``sum(coefficient[f] * features[f])`` over ``SPEC_COST_FEATURES``, from a calibrated profile."""

    method: str
    coefficients: dict[str, float]

    def seconds(self, features: Mapping[str, Any]) -> float:
        if not features.get("spec_decode_num_drafts"):
            return 0.0
        return sum(c * float(features.get(name) or 0) for name, c in self.coefficients.items())

    def describe(self) -> str:
        return f"calibrated:{self.method}"


@dataclasses.dataclass
class ForwardsProposerCost(ProposerCost):
    """A model's K forwards over the requests that propose: ``max_proposed`` forwards of ``rows`` requests each
    (the draft model's own step-time model, ``draft``), at ``fraction`` of its layers' cost (``layer_skip``).
    The first forward feeds what the step's ``spec_proposer_fed_tokens`` holds beyond the later forwards' one
    token a request each (a new request's prompt, priced as a prefill chunk)."""

    method: str
    model: StepTimeModel
    fraction: float = 1.0

    def seconds(self, features: Mapping[str, Any]) -> float:
        forwards = int(features.get("spec_decode_max_proposed") or 0)
        rows = int(features.get("spec_decode_num_drafts") or 0)
        if not forwards or not rows:
            return 0.0
        seqs = max(1, int(features.get("num_decode_seqs") or rows))
        context = int(features.get("context_tokens") or 0) * rows // seqs   # the proposing requests' share
        one = {"num_prefill_tokens": 0, "num_decode_tokens": rows, "num_prefill_seqs": 0, "num_decode_seqs": rows,
               "num_sampled": rows, "context_tokens": context, "attn_pairs": context + rows}
        decode = self.model.predict(one, 0.0)
        first_fed = int(features.get("spec_proposer_fed_tokens") or 0) - (forwards - 1) * rows
        if first_fed <= rows:   # no catch-up beyond one token a request (or a record without the count)
            return forwards * self.fraction * decode
        # The catch-up: the first forward computes ``first_fed`` tokens of the requests' contexts, as a prefill.
        catch_up = {**one, "num_prefill_tokens": first_fed, "num_decode_tokens": 0, "num_prefill_seqs": rows,
                    "num_decode_seqs": 0, "attn_pairs": context + first_fed * (first_fed + 1) // (2 * rows)}
        return self.fraction * (self.model.predict(catch_up, 0.0) + (forwards - 1) * decode)

    def describe(self) -> str:
        return f"{self.method}:{self.fraction:g}x{self.model.describe()}"


def calibrated_cost(profile: Mapping[str, Any], path: Any, method: str) -> CalibratedProposerCost:
    """The proposer cost a calibrated profile holds for ``method``; ``ValueError`` naming ``runner.profile`` when
    it has none (a profile fitted on runs without that proposer)."""
    section = profile.get("speculation")
    if not isinstance(section, Mapping) or section.get("method") != method:
        fitted = section.get("method") if isinstance(section, Mapping) else None
        raise ValueError(
            f"runner.profile: {Path(str(path)).name} prices no speculative={method} (it was fitted on runs "
            f"{'with ' + repr(fitted) if fitted else 'without speculation'}); calibrate one from real runs "
            f"with speculative={method}: python -m nanovllm.harness.sim.calibrate RUN_DIR... --out FILE, "
            "then runner.profile=FILE")
    return CalibratedProposerCost(method, {k: float(v) for k, v in section["coefficients"].items()})


def analytical_cost(speculative: Mapping[str, Any], hf_config: Any, cost: ModelCost, hardware: Hardware | None,
                    dtype: str) -> ProposerCost:
    """A proposer's cost on ``hardware`` from the analytical roofline: ``draft`` as the draft model's forwards
    (its ``model``'s config, else the target's architecture in the default GGUF file's blocks), ``layer_skip`` as
    ``num_layers / L`` of the target's; ``ngram`` (and any other proposer without a model) as free."""
    method = str(speculative["method"])
    if method == "draft":
        draft_model = speculative.get("model")
        if draft_model and Path(str(draft_model)).is_dir():
            from transformers import AutoConfig

            draft_config = AutoConfig.from_pretrained(str(draft_model))
            quantization = speculative.get("quantization")
            quantization = None if quantization in (None, "auto") else quantization
        else:   # the default: the target's own architecture as a GGUF file (4-bit blocks)
            draft_config, quantization = hf_config, "gguf"
        import torch

        draft_cost = ModelCost.from_hf_config(draft_config, getattr(torch, dtype), "auto", quantization,
                                              None if quantization == "gguf" and not draft_model else draft_model)
        return ForwardsProposerCost(method, AnalyticalStepTime(draft_cost, hardware, dtype))
    if method == "layer_skip":
        layers = speculative.get("num_layers") or cost.num_layers // 2
        return ForwardsProposerCost(method, AnalyticalStepTime(cost, hardware, dtype), layers / cost.num_layers)
    return ProposerCost()


class SpeculativeStepTime(StepTimeModel):
    """A step-time model for steps that verify proposals: the base model on ``verify_features`` plus the
    proposer's cost. Built by ``Simulation.build`` around the run's step-time model when speculation is on."""

    def __init__(self, base: StepTimeModel, proposer: ProposerCost) -> None:
        self.base, self.proposer = base, proposer
        self.machine_seconds = base.machine_seconds
        self.pure = base.pure   # a replayed timeline stays impure when it prices proposals too
        self.kv_tier_links = base.kv_tier_links

    def predict(self, features: Mapping[str, int], now: float) -> float:
        features = spec_features(features)
        return self.base.predict(verify_features(features), now) + self.proposer.seconds(features)

    def describe(self) -> str:
        return f"{self.base.describe()}+proposer:{self.proposer.describe()}"


# -- acceptance ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RequestProfile:
    """How one request's proposals behave: the chance that the proposer has one when asked (``propose_rate``),
    the mean proposal length when it has (``mean_length``: ``None`` = as many as allowed), and ``p``, the chance
    that each proposed token is accepted given the ones before it were."""

    propose_rate: float
    mean_length: float | None
    p: float


def continuation_for_rate(rate: float, length: float) -> float:
    """The per-position continuation ``p`` at which proposals of ``length`` tokens are accepted at ``rate`` per
    token: ``(p + p^2 + ... + p^n) / n = rate`` (n = ``length`` rounded, at least 1), by bisection."""
    n = max(1, round(length))
    rate = min(max(rate, 0.0), 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(1, n + 1)) / n < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def request_profiles(run_dir: str | Path) -> tuple[dict[str, RequestProfile], dict[str, int]]:
    """request_id -> ``RequestProfile`` of every request of a real run that decoded at least once, and
    request_id -> its decode steps, from its
    ``requests.jsonl``: a request that emitted ``o`` tokens, ``a`` of them accepted proposals, decoded in
    ``o - 1 - a`` steps; the proposer, asked ``spec_proposer_asks`` times, proposed ``spec_proposals`` times,
    ``spec_proposal_tokens / spec_proposals`` tokens long (a record without those counts: proposals verified in
    ``num_drafts`` of its steps, ``num_draft_tokens / num_drafts`` long), and ``a / num_draft_tokens`` of its
    verified tokens were accepted. ``ValueError`` naming
    ``runner.acceptance_run`` for a run that proposed nothing."""
    data = read_run(run_dir, missing_ok=False)
    if data.metrics.get("simulated"):
        raise ValueError(f"runner.acceptance_run: {run_dir} is a simulated run; fit acceptance on a real one")
    profiles: dict[str, RequestProfile] = {}
    decode_steps: dict[str, int] = {}
    for record in data.requests:
        drafts = int(record.get("spec_decode_num_drafts") or 0)
        tokens = int(record.get("spec_decode_num_draft_tokens") or 0)
        accepted = int(record.get("spec_decode_num_accepted_tokens") or 0)
        steps = int(record.get("num_output_tokens") or 0) - 1 - accepted
        if steps <= 0:
            continue
        rate = accepted / tokens if tokens else 0.0
        asks = int(record.get("spec_proposer_asks") or 0)
        if asks:
            # The proposer's own rate and lengths, before the scheduler dropped any: the simulated scheduler drops
            # proposals for lack of budget or blocks itself, so rates read after that would count the drops twice.
            proposals = int(record.get("spec_proposals") or 0)
            propose_rate = proposals / asks
            length = int(record.get("spec_proposal_tokens") or 0) / proposals if proposals else None
        else:   # a run recorded before the proposer's own counts: what rode along
            propose_rate = min(1.0, drafts / steps)
            length = tokens / drafts if drafts else None
        profiles[str(record["request_id"])] = RequestProfile(
            propose_rate, length, continuation_for_rate(rate, (tokens / drafts) if drafts else 1.0))
        decode_steps[str(record["request_id"])] = steps
    if not any(p.propose_rate > 0 for p in profiles.values()):
        raise ValueError(f"runner.acceptance_run: {run_dir} has no request with proposals (a real run with "
                         "speculative=<the simulated proposer> is needed)")
    return profiles, decode_steps


def run_method(run_dir: str | Path) -> str | None:
    """The proposer a recorded run used (its ``config.json``'s ``speculative.method``), None if none/unknown."""
    config = read_config(run_dir) or {}
    return (config.get("speculative") or {}).get("method")


class ProfileAcceptance(AcceptanceModel):
    """Proposals and acceptance from per-request ``RequestProfile`` s, drawn with one ``random.Random`` per
    request seeded by ``seed`` and its id (so a request's draws do not depend on the order of the others)."""

    def __init__(self, profile_of: Any, seed: int = 0, name: str = "profiles") -> None:
        self.profile_of, self.seed, self.name = profile_of, seed, name
        self._state: dict[str, tuple[random.Random, RequestProfile]] = {}

    def _of(self, request: Request) -> tuple[random.Random, RequestProfile]:
        state = self._state.get(request.request_id)
        if state is None:
            rng = random.Random(f"{self.seed}:{request.request_id}")
            state = self._state[request.request_id] = (rng, self.profile_of(request, rng))
        return state

    def num_proposed(self, request: Request, num_tokens: int) -> int:
        rng, profile = self._of(request)
        if rng.random() >= profile.propose_rate:
            return 0
        if profile.mean_length is None:
            return num_tokens
        # Lengths around the recorded mean: its floor or ceiling, as often as makes the mean.
        whole = int(profile.mean_length)
        length = whole + (rng.random() < profile.mean_length - whole)
        return max(1, min(num_tokens, length))

    def num_accepted(self, request: Request, num_proposed: int) -> int:
        rng, profile = self._of(request)
        accepted = 0
        while accepted < num_proposed and rng.random() < profile.p:
            accepted += 1
        return accepted

    def on_finish(self, request: Request) -> None:
        self._state.pop(request.request_id, None)

    def describe(self) -> str:
        return self.name


def build_acceptance(acceptance: Any, run: str | Path | None, seed: Any, method: str,
                     num_tokens: int) -> AcceptanceModel:
    """The ``runner.acceptance`` model (a rate in [0, 1], ``fitted`` or ``replay`` of ``runner.acceptance_run``)
    for the proposer ``method``; ``ValueError`` naming the field for anything else."""
    if acceptance is None:
        raise ValueError("runner.acceptance: simulating speculative decoding needs an acceptance model: "
                         "runner.acceptance=fitted or replay (with runner.acceptance_run=RUN_DIR, a real run with "
                         f"speculative={method}), or a per-token acceptance rate in [0, 1]")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"runner.acceptance_seed must be an integer, got {seed!r}")
    if isinstance(acceptance, (int, float)) and not isinstance(acceptance, bool):
        rate = float(acceptance)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"runner.acceptance: a per-token acceptance rate must be in [0, 1], got {acceptance!r}")
        fixed = RequestProfile(1.0, None, continuation_for_rate(rate, num_tokens))
        return ProfileAcceptance(lambda request, rng: fixed, seed, f"rate:{rate:g}")
    if acceptance not in ACCEPTANCE_MODELS:
        raise ValueError(f"runner.acceptance must be a per-token acceptance rate in [0, 1], "
                         f"{' or '.join(ACCEPTANCE_MODELS)}, got {acceptance!r}")
    if not run:
        raise ValueError(f"runner.acceptance_run: runner.acceptance={acceptance} needs the directory of a real run "
                         f"with speculative={method} to take the requests' acceptance from")
    recorded = run_method(run)
    if recorded is not None and recorded != method:
        raise ValueError(f"runner.acceptance_run: {run} used speculative={recorded}, this run {method}; "
                         "acceptance is the proposer's own")
    profiles, steps = request_profiles(run)
    name = f"{acceptance}:{Path(str(run)).name}"
    if acceptance == "replay":
        def own(request: Request, rng: random.Random) -> RequestProfile:
            if request.request_id not in profiles:
                raise ValueError(f"runner.acceptance=replay: request {request.request_id} is not in "
                                 f"{run} (replay needs the run's own workload; use fitted for another)")
            return profiles[request.request_id]
        return ProfileAcceptance(own, seed, name)
    pool: Sequence[RequestProfile] = [profiles[k] for k in sorted(profiles)]
    # Weighted by decode steps, so that the simulated steps see the recorded steps' mix (drawn uniformly, a short
    # request with a lucky rate would count as much as a long one).
    weights = [steps[k] for k in sorted(profiles)]
    return ProfileAcceptance(lambda request, rng: rng.choices(pool, weights)[0], seed, name)
