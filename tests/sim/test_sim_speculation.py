"""Simulated speculative decoding (``runner=sim`` with ``speculative``): the engine's own speculation policy,
scheduler budgets and counters on the simulated runner; the acceptance model (``runner.acceptance``) and the
pricing of proposals and the proposer (``nanovllm.harness.sim.speculation``); calibration from runs with
speculation; bad settings. The comparison with a real run is the slow test at the end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import expected_fed_tokens
from nanovllm.config import EngineConfig
from nanovllm.harness.sim import Hardware, Simulation
from nanovllm.harness.sim.calibrate import fit_profile
from nanovllm.harness.sim.speculation import (
    SPEC_COST_FEATURES,
    ProfileAcceptance,
    RequestProfile,
    continuation_for_rate,
    request_profiles,
    verify_features,
)
from nanovllm.harness.workload import WorkloadRequest
from nanovllm.spec_policy import SPEC_POLICIES

ROOT = Path(__file__).resolve().parents[2]
TOKEN_COST = {"name": "token_cost", "step_overhead": 0.02, "time_per_token": 0.001}


def _spec(method: str = "ngram", k: int = 3, policy=None) -> dict:
    return dict(method=method, num_speculative_tokens=k, **({"policy": policy} if policy else {}))


def _workload(n: int = 12, prompt_len: int = 40, max_tokens: int = 40, gap: float = 0.05) -> list[WorkloadRequest]:
    return [WorkloadRequest(prompt=[(7 * i + j) % 500 + 10 for j in range(prompt_len)], max_tokens=max_tokens,
                            arrival_time=gap * i, request_id=str(i), ignore_eos=True) for i in range(n)]


def _serve(speculative: dict | None, acceptance=0.6, seed: int = 0, step_time=TOKEN_COST, n: int = 12,
           **engine) -> tuple[Simulation, object]:
    options = {**dict(num_kv_blocks=64, block_size=16, max_num_seqs=4, max_model_len=256), **engine}
    sim = Simulation.build(EngineConfig(speculative=speculative, **options), step_time,
                           acceptance=acceptance if speculative else None, acceptance_seed=seed)
    return sim, sim.serve(_workload(n))


def test_simulated_speculation_counts_like_the_engine_and_emits_the_same_tokens():
    _, plain = _serve(None)
    sim, spec = _serve(_spec())
    steps = spec.steps
    drafts = sum(s["spec_decode_num_drafts"] for s in steps)
    proposed = sum(s["spec_decode_num_draft_tokens"] for s in steps)
    accepted = sum(s["spec_decode_num_accepted_tokens"] for s in steps)
    assert drafts > 0 and 0 < accepted < proposed
    # Each step's decode tokens are its decodes plus the proposals it verified.
    for s in steps:
        assert s["num_decode_tokens"] == s["num_decode_seqs"] + s["spec_decode_num_draft_tokens"]
        per_pos = s["spec_decode_num_accepted_tokens_per_pos"]
        assert sum(per_pos) == s["spec_decode_num_accepted_tokens"]
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))   # accepted runs are prefixes
    # The requests' own counters add up to the steps', and the summary carries vLLM's keys.
    assert sum(r["spec_decode_num_accepted_tokens"] for r in spec.requests) == accepted
    assert sum(r["spec_decode_num_draft_tokens"] for r in spec.requests) == proposed
    summary = spec.summary
    assert summary["spec_decode_num_drafts"] == drafts and summary["spec_decode_num_accepted_tokens"] == accepted
    assert summary["spec_decode_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert summary["spec_decode_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)
    # Accepted proposals are the tokens decoding one at a time gives: the outputs are those of the plain run.
    assert spec.output_token_ids == plain.output_token_ids and len(spec.output_token_ids) == 12
    # Fewer steps, and each accepted token saved one: the virtual clock says the run was faster.
    assert len(plain.steps) - len(steps) > 0
    assert summary["output_throughput"] > plain.summary["output_throughput"]
    assert sim.annotations["acceptance_model"] == "rate:0.6"


def test_the_acceptance_rate_comes_out_as_configured():
    _, spec = _serve(_spec(k=4), acceptance=0.4, n=24)
    assert spec.summary["spec_decode_acceptance_rate"] == pytest.approx(0.4, abs=0.06)
    _, never = _serve(_spec(), acceptance=0.0)
    assert never.summary["spec_decode_num_accepted_tokens"] == 0 and never.summary["spec_decode_num_drafts"] > 0
    _, always = _serve(_spec(), acceptance=1.0)
    assert always.summary["spec_decode_acceptance_rate"] == 1.0


def test_a_seed_reproduces_the_run_and_another_seed_changes_it():
    def accepted(seed: int) -> list:
        _, result = _serve(_spec(), seed=seed)
        return [(s["spec_decode_num_drafts"], s["spec_decode_num_accepted_tokens"], s["duration"])
                for s in result.steps]

    assert accepted(3) == accepted(3)
    assert accepted(3) != accepted(4)


def test_proposals_count_against_the_token_budget_and_the_kv_blocks():
    # A budget of 6 tokens: a decode with 3 proposals leaves 2 for prompt chunks; where a chunk needs more,
    # proposals are cut to fit (never a prompt's tokens).
    sim, result = _serve(_spec(k=3), acceptance=1.0, max_num_batched_tokens=6, enable_chunked_prefill=True,
                         num_kv_blocks=24)
    steps = result.steps
    assert all(s["num_prefill_tokens"] + s["num_decode_tokens"] <= 6 for s in steps)
    assert any(0 < s["spec_decode_num_draft_tokens"] < 3 * s["spec_decode_num_drafts"]
               and s["num_prefill_tokens"] + s["num_decode_tokens"] == 6 for s in steps)
    assert all(s["kv_blocks_used"] <= 24 for s in steps)
    assert len(result.requests) == 12 and all(r["finish_reason"] == "length" for r in result.requests)
    assert sim.engine.allocator.num_used_blocks() == 0


def test_fitted_acceptance_reads_the_proposers_own_rate_not_what_survived_the_scheduler(tmp_path):
    # A cache so small that the scheduler drops proposals for lack of blocks: the records count what the proposer
    # proposed apart from what rode along, and the profiles fitted on them take the proposer's own rate (a
    # simulation on them drops proposals again itself: reading the survivors would count the drops twice).
    _, squeezed = _serve(_spec(k=3), acceptance=1.0, num_kv_blocks=12, max_num_seqs=4)
    records = squeezed.requests
    assert all(r["spec_proposals"] == r["spec_proposer_asks"] > 0 for r in records)   # rate 1: always proposes
    assert all(r["spec_proposal_tokens"] >= r["spec_decode_num_draft_tokens"] for r in records)
    dropped = [r for r in records if r["spec_decode_num_drafts"] < r["spec_proposals"]]
    assert dropped, "the small cache should have dropped some proposals"
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "steps.jsonl").write_text("")
    (tmp_path / "metrics.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"speculative": {"method": "ngram"}}))
    profiles, steps = request_profiles(tmp_path)
    assert {profile.propose_rate for profile in profiles.values()} == {1.0}
    # What survived the scheduler is lower for the squeezed requests: the rate a run without these counts gives.
    assert any(r["spec_decode_num_drafts"] / steps[r["request_id"]] < 1.0 for r in dropped)


@pytest.mark.parametrize("policy", ["fixed", "off_above_batch", "adaptive"])
def test_the_simulated_engine_runs_the_engines_own_speculation_policies(policy):
    spec = _spec(policy={"name": "off_above_batch", "max_batch": 2} if policy == "off_above_batch" else policy)
    sim, result = _serve(spec)
    assert type(sim.engine.speculator.policy) is SPEC_POLICIES.get(policy)
    assert result.summary["spec_decode_num_drafts"] > 0
    if policy == "off_above_batch":   # nothing proposed while more than 2 requests ran
        assert all(s["spec_decode_num_drafts"] == 0 for s in result.steps if s["num_decode_seqs"] > 2)
        assert any(s["num_decode_seqs"] > 2 for s in result.steps)


def test_adaptive_turns_speculation_down_when_nothing_is_accepted():
    _, fixed = _serve(_spec(), acceptance=0.0, n=16)
    _, adaptive = _serve(_spec(policy="adaptive"), acceptance=0.0, n=16)
    assert adaptive.summary["spec_decode_num_draft_tokens"] < fixed.summary["spec_decode_num_draft_tokens"] / 2


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
def test_the_simulated_draft_is_fed_as_the_real_one_is(acceptance):
    # One request at a time: each step's fed tokens follow the real draft's rule (tested against the real draft
    # model in tests/spec/test_draft_proposer.py), whatever was accepted; ngram runs no model and counts none.
    sim = Simulation.build(EngineConfig(speculative=_spec("draft"), num_kv_blocks=64, block_size=16, max_num_seqs=1,
                                        max_model_len=256), TOKEN_COST, acceptance=acceptance)
    result = sim.serve(_workload(n=1))
    fed = [s["spec_proposer_fed_tokens"] for s in result.steps]
    assert fed == expected_fed_tokens(40, result.steps)
    assert fed[1] == 40 + 1 + 2 and sum(fed) > 40
    if acceptance == 1.0:   # every proposal accepted: the target's token and the unfed last proposal, + 2 proposals
        assert set(fed[2:-3]) == {2 + 2}
    if acceptance == 0.0:
        assert set(fed[2:-3]) == {1 + 2}
    _, ngram = _serve(_spec("ngram"), n=1)
    assert all("spec_proposer_fed_tokens" not in s for s in ngram.steps)


def test_a_verify_step_is_priced_as_its_tokens_plus_the_proposers_cost():
    features = {"num_prefill_tokens": 0, "num_decode_tokens": 8, "num_prefill_seqs": 0, "num_decode_seqs": 2,
                "num_sampled": 2, "context_tokens": 100, "attn_pairs": 120, "spec_decode_num_draft_tokens": 6,
                "spec_decode_num_drafts": 2, "spec_decode_max_proposed": 3}
    priced = verify_features(features)
    assert (priced["num_prefill_tokens"], priced["num_decode_tokens"], priced["num_sampled"]) == (6, 2, 8)
    assert verify_features({**features, "spec_decode_num_draft_tokens": 0}) == \
        {**features, "spec_decode_num_draft_tokens": 0}
    # Analytical: a draft's K forwards and layer_skip's early layers cost something; layer_skip less than the
    # full model would, ngram nothing.
    h100 = Hardware.from_config(yaml.safe_load((ROOT / "conf/hardware/h100_sxm.yaml").read_text()))
    costs = {}
    for method, extra in (("ngram", {}), ("draft", {}), ("layer_skip", {"num_layers": 10})):
        sim = Simulation.build(EngineConfig(dtype="bfloat16", num_kv_blocks=64, speculative={**_spec(method), **extra}),
                               "analytical", hardware=h100, acceptance=0.5)
        costs[method] = sim.model.proposer.seconds(features)
        base = sim.model.base.predict(features, 0.0)
    assert costs["ngram"] == 0.0 and costs["draft"] > 0 and costs["layer_skip"] > 0
    assert costs["layer_skip"] < 3 * base * 10 / 30
    # A step whose first draft forward also catches up on a new request's 2,000-token prompt costs more than one
    # that feeds one token a request; a count of one token a request changes nothing.
    draft = Simulation.build(EngineConfig(dtype="bfloat16", num_kv_blocks=64, speculative=_spec("draft")),
                             "analytical", hardware=h100, acceptance=0.5).model.proposer
    steady = {**features, "spec_proposer_fed_tokens": 2 + 2 * 2}
    assert draft.seconds(steady) == costs["draft"]
    assert draft.seconds({**features, "spec_proposer_fed_tokens": 2000 + 2 * 2}) > costs["draft"]


def test_calibration_on_speculative_steps_recovers_the_proposers_cost():
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(200):
        prefill = int(rng.integers(0, 2)) * int(rng.integers(10, 200))
        seqs = int(rng.integers(1, 6))
        k = int(rng.integers(0, 4)) if not prefill else 0
        context = int(rng.integers(50, 400)) * seqs
        step = {"num_prefill_tokens": prefill, "num_decode_seqs": seqs, "num_decode_tokens": seqs * (1 + k),
                "num_prefill_seqs": int(prefill > 0), "num_sampled": seqs + int(prefill > 0),
                "context_tokens": context, "attn_pairs": context + prefill * prefill // 2,
                "spec_decode_num_drafts": seqs if k else 0, "spec_decode_num_draft_tokens": seqs * k,
                "spec_decode_num_accepted_tokens_per_pos": [0] * k}
        # The draft model's catch-up on a new request's prompt, in a third of the proposing steps.
        catch_up = int(rng.integers(20, 300)) if k and rng.random() < 0.3 else 0
        step["spec_proposer_fed_tokens"] = seqs * k + catch_up if k else 0
        priced = verify_features(step)
        step["duration"] = (0.01 + 2e-4 * priced["num_prefill_tokens"] + 1e-3 * seqs + 1e-6 * context
                            + (0.004 * k + 0.0005 * seqs * k + 1e-4 * step["spec_proposer_fed_tokens"] if k
                               else 0.0))
        steps.append(step)
    profile = fit_profile(steps, speculation="draft")
    spec = profile["speculation"]
    assert spec["method"] == "draft" and set(spec["coefficients"]) == set(SPEC_COST_FEATURES)
    assert spec["coefficients"]["spec_decode_max_proposed"] == pytest.approx(0.004, rel=0.05)
    assert spec["coefficients"]["spec_decode_num_draft_tokens"] == pytest.approx(0.0005, rel=0.05)
    assert spec["coefficients"]["spec_proposer_fed_tokens"] == pytest.approx(1e-4, rel=0.05)
    assert profile["coefficients"]["num_prefill_tokens"] == pytest.approx(2e-4, rel=0.05)
    assert not set(SPEC_COST_FEATURES) & set(profile["coefficients"])


def test_fitted_acceptance_draws_each_request_a_real_requests_profile(tmp_path):
    records = [{"request_id": "a", "num_output_tokens": 41, "spec_decode_num_drafts": 20,
                "spec_decode_num_draft_tokens": 60, "spec_decode_num_accepted_tokens": 20},
               {"request_id": "b", "num_output_tokens": 11, "spec_decode_num_drafts": 0,
                "spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0}]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "steps.jsonl").write_text("")
    (tmp_path / "metrics.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"speculative": {"method": "ngram"}}))
    config = EngineConfig(speculative=_spec(), num_kv_blocks=64, max_num_seqs=4, max_model_len=256)
    sim = Simulation.build(config, TOKEN_COST, acceptance="fitted", acceptance_run=str(tmp_path))
    result = sim.serve(_workload(20))
    drafts_by_request = [r["spec_decode_num_drafts"] for r in result.requests]
    # Request "b" never had a proposal: requests that drew it propose nothing; those that drew "a" propose.
    assert 0 in drafts_by_request and any(d > 0 for d in drafts_by_request)
    with pytest.raises(ValueError, match="runner.acceptance_run: .* used speculative=ngram, this run draft"):
        Simulation.build(EngineConfig(speculative=_spec("draft"), num_kv_blocks=64), TOKEN_COST,
                         acceptance="fitted", acceptance_run=str(tmp_path))
    replay = Simulation.build(config, TOKEN_COST, acceptance="replay", acceptance_run=str(tmp_path))
    with pytest.raises(Exception, match="request 0 is not in"):
        replay.serve(_workload(2))


def test_per_request_profiles_reach_their_rate():
    p = continuation_for_rate(0.5, 3)
    assert (p + p ** 2 + p ** 3) / 3 == pytest.approx(0.5, abs=1e-6)
    model = ProfileAcceptance(lambda request, rng: RequestProfile(0.5, 2.0, 1.0), seed=1)

    class R:
        request_id = "x"

    proposed = [model.num_proposed(R(), 3) for _ in range(2000)]
    assert set(proposed) == {0, 2} and 0.45 < proposed.count(2) / 2000 < 0.55


@pytest.mark.parametrize("build, message", [
    (dict(acceptance=None), "runner.acceptance: simulating speculative decoding needs an acceptance model"),
    (dict(acceptance=1.5), r"runner.acceptance: a per-token acceptance rate must be in \[0, 1\], got 1.5"),
    (dict(acceptance="guess"), "runner.acceptance must be a per-token acceptance rate in .*got 'guess'"),
    (dict(acceptance="fitted"), "runner.acceptance_run: runner.acceptance=fitted needs the directory"),
    (dict(acceptance=0.5, acceptance_seed="x"), "runner.acceptance_seed must be an integer"),
])
def test_bad_acceptance_settings_name_the_field(build, message):
    with pytest.raises(ValueError, match=message):
        Simulation.build(EngineConfig(speculative=_spec(), num_kv_blocks=64), TOKEN_COST, **build)


def test_a_profile_without_the_proposers_cost_is_refused_naming_runner_profile(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump({"dtype": "float32", "intercept": 0.01,
                                       "coefficients": {"num_decode_seqs": 0.001}}))
    with pytest.raises(ValueError, match="runner.profile: p.yaml prices no speculative=draft .*without speculation"):
        Simulation.build(EngineConfig(speculative=_spec("draft"), num_kv_blocks=64), "calibrated",
                         profile=str(profile), acceptance=0.5)
    profile.write_text(yaml.safe_dump({"dtype": "float32", "intercept": 0.01,
                                       "coefficients": {"num_decode_seqs": 0.001, "num_prefill_tokens": 1e-4},
                                       "speculation": {"method": "draft", "coefficients": {
                                           "spec_decode_max_proposed": 0.003, "spec_decode_num_draft_tokens": 0.0,
                                           "spec_decode_num_drafts": 0.0}}}))
    sim = Simulation.build(EngineConfig(speculative=_spec("draft"), num_kv_blocks=64, max_model_len=256),
                           "calibrated", profile=str(profile), acceptance=0.5)
    result = sim.serve(_workload(4))
    # A step verifying proposals costs its proposals as prompt rows plus three draft forwards.
    step = next(s for s in result.steps if s["spec_decode_num_drafts"] and not s["num_prefill_tokens"])
    assert step["duration"] == pytest.approx(0.01 + 0.001 * step["num_decode_seqs"]
                                             + 1e-4 * step["spec_decode_num_draft_tokens"] + 0.003 * 3)


@pytest.mark.slow
def test_a_short_real_run_and_its_simulation_agree_loosely(tmp_path):
    """Real ``ngram`` run (chat prompts, float32, one thread), calibrated and replayed per request: the
    simulation's acceptance and throughput are near the real run's (loosely: one short noisy run)."""
    run, sim = tmp_path / "real", tmp_path / "sim"
    common = ["workload=chat", "workload.num_requests=6", "workload.request_rate=1", "workload.max_tokens=32",
              "speculative=ngram", "engine.max_num_seqs=4", "progress=false", "monitor.calibrate=false",
              "engine.dtype=float32"]
    env_run = [sys.executable, "-m", "nanovllm.run"]
    subprocess.run([*env_run, *common, f"hydra.run.dir={run}"], check=True, cwd=ROOT, capture_output=True)
    subprocess.run([sys.executable, "-m", "nanovllm.harness.sim.calibrate", str(run), "--out",
                    str(tmp_path / "p.yaml")], check=True, cwd=ROOT, capture_output=True)
    subprocess.run([*env_run, *common, "runner=sim", f"runner.profile={tmp_path / 'p.yaml'}",
                    "runner.acceptance=replay", f"runner.acceptance_run={run}", f"runner.output_lengths_from={run}",
                    f"hydra.run.dir={sim}"], check=True, cwd=ROOT, capture_output=True)
    real_m, sim_m = (json.loads((d / "metrics.json").read_text()) for d in (run, sim))
    assert sim_m["simulated"] is True and sim_m["acceptance_model"].startswith("replay:")
    assert real_m["spec_decode_num_drafts"] > 0 and sim_m["spec_decode_num_drafts"] > 0
    assert sim_m["spec_decode_acceptance_rate"] == pytest.approx(real_m["spec_decode_acceptance_rate"], abs=0.2)
    assert sim_m["output_throughput"] == pytest.approx(real_m["output_throughput"], rel=0.5)
