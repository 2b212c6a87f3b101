"""Every built-in policy's waiting-queue declaration is honest, and keeping the queue incrementally changes no
decision: each policy serves a contended workload (bursts of simultaneous arrivals, shared prefixes, priorities,
clients, SLOs, a cache small enough to preempt) once as declared and once as the scheduler ran every policy before
(``resorted_every_step``: a full re-sort and a rejection scan at every step), and both runs' request and step
records are identical. In the second run every key the policy gives a waiting request is recorded: a "static"
key never changes while the request waits, a "timed" one only once the time ``priority_changes_at`` named has
come. edf's ``reject_after`` never names a time later than its ``reject_reason`` rejects."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import REPO, make_request, simulate, workload_request
from nanovllm import POLICIES, RequestStatus
from nanovllm.policy import resorted_every_step

SPECS = [
    "fcfs", "priority", "random", "prefill_first", {"name": "sarathi", "token_budget": 24},
    {"name": "mlfq", "quantum": 8, "preempt": True},
    "sjf", {"name": "sjf", "max_wait": 12.0}, {"name": "sjf", "predictor": "prompt_length", "max_wait": 7.5},
    {"name": "sjf", "predictor": "client_history", "max_wait": 9.0},
    "edf", {"name": "edf", "step_time": 1.0}, {"name": "edf", "deadline": "e2el", "step_time": 0.5},
    "fair", "lpm", {"name": "lpm", "max_wait": 6.0},
]


def _label(spec) -> str:
    return spec if isinstance(spec, str) else "-".join(f"{v}" for v in spec.values())


def _contended_workload(seed: int = 0, n: int = 60):
    """Bursts of requests arriving at the same instant (ties everywhere), prompts sharing four system prompts,
    three priorities, four clients and per-request TTFT / end-to-end SLOs, in engine steps."""
    rng = np.random.default_rng(seed)
    systems = [[int(t) for t in rng.integers(1000, 30000, 16)] for _ in range(4)]
    requests, t = [], 0.0
    for i in range(n):
        if i % 6 == 0:
            t += float(rng.choice([0.0, 1.0, 4.0, 9.0]))
        prompt = systems[int(rng.integers(4))] + [int(x) for x in rng.integers(1000, 30000, int(rng.integers(1, 24)))]
        requests.append(workload_request(
            f"r{i}", prompt, int(rng.integers(1, 24)), arrival=t, priority=int(rng.integers(3)),
            client_id=f"c{int(rng.integers(4))}", slo_ttft=float(rng.choice([3.0, 8.0, 20.0, 60.0])),
            slo_e2el=float(rng.choice([15.0, 40.0, 120.0]))))
    return requests


class _KeyLog:
    """Wraps a policy instance's ``priority``: each key given to a waiting request, with the time its policy
    says it may next change (for "timed"), per stay in the waiting queue (a preemption starts a new stay)."""

    def __init__(self, policy) -> None:
        self.stays: dict[tuple[str, int], list[tuple[float, object, float | None]]] = defaultdict(list)
        original = policy.priority

        def priority(request, now):
            key = original(request, now)
            if request.status is not RequestStatus.RUNNING:
                changes = policy.priority_changes_at(request, now)
                self.stays[(request.request_id, request.num_preemptions)].append((now, key, changes))
            return key

        policy.priority = priority


def _build(spec, reference: bool):
    name, options = (spec, {}) if isinstance(spec, str) else (spec["name"], {k: v for k, v in spec.items()
                                                                              if k != "name"})
    cls = POLICIES.get(name)
    return (resorted_every_step(cls) if reference else cls)(**options)


def _serve(policy):
    return simulate(policy, _contended_workload(), allocator="prefix", num_blocks=16, max_num_seqs=4,
                    max_num_batched_tokens=48)


@pytest.mark.parametrize("spec", SPECS, ids=_label)
def test_declared_waiting_queue_serves_exactly_as_the_full_resort_and_the_declaration_holds(spec):
    declared, reference = _build(spec, reference=False), _build(spec, reference=True)
    waiting_key = declared.waiting_key
    log = _KeyLog(reference)
    incremental, resorted = _serve(declared), _serve(reference)
    assert incremental.requests == resorted.requests
    assert incremental.steps == resorted.steps
    assert sum(r["num_preemptions"] for r in resorted.requests) > 0   # the workload does preempt
    if waiting_key != "dynamic":
        _assert_declaration_holds(log, timed=waiting_key == "timed")


def _assert_declaration_holds(log: _KeyLog, timed: bool) -> None:
    """Every stay's keys change only where the queue recomputes them: never ("static"), or at the first
    ordering at or past the time ``priority_changes_at`` named when the key was last computed ("timed")."""
    for stay, keys in log.stays.items():
        _, key, valid_until = keys[0]
        for now, now_key, changes in keys[1:]:
            if timed and valid_until is not None and now >= valid_until:
                key, valid_until = now_key, changes   # its time came: the queue recomputes it here
            assert now_key == key, (stay, keys)


def test_the_workload_has_simultaneous_arrivals_rejections_and_aging():
    arrivals = [r.arrival_time for r in _contended_workload()]
    assert len(set(arrivals)) < len(arrivals) / 3
    edf = _serve(_build({"name": "edf", "step_time": 1.0}, reference=False)).requests
    assert any(r["error"] for r in edf) and not all(r["error"] for r in edf)
    log = _KeyLog(policy := _build({"name": "sjf", "max_wait": 12.0}, reference=True))
    _serve(policy)
    assert any(len({key for _, key, _ in keys}) > 1 for keys in log.stays.values())   # promotions happened


@settings(max_examples=300, deadline=None)
@given(arrival=st.floats(0, 1e9), slo=st.floats(1e-3, 1e4), step_time=st.floats(0, 10),
       max_tokens=st.integers(1, 64), deadline=st.sampled_from(["ttft", "e2el"]),
       offset=st.floats(-1e-3, 1e-3))
def test_edf_reject_after_is_never_later_than_reject_reason_rejects(arrival, slo, step_time, max_tokens, deadline,
                                                                     offset):
    edf = POLICIES.build({"name": "edf", "deadline": deadline, "step_time": step_time})
    request = make_request("r", max_tokens=max_tokens, arrival=arrival, slo_ttft=slo, slo_e2el=slo)
    after = edf.reject_after(request, arrival)
    steps = 1 if deadline == "ttft" else max_tokens
    threshold = arrival + slo - step_time * steps
    for now in (after, math.nextafter(after, -math.inf), threshold + offset, threshold, math.nextafter(threshold, math.inf)):
        if edf.reject_reason(request, now) is not None:
            assert now >= after
    assert after <= threshold and threshold - after <= 1e-6 * max(1.0, abs(arrival) + slo + step_time * steps)
    request.status = RequestStatus.PREEMPTED   # a preempted request is never rejected: no timer
    assert edf.reject_after(request, arrival) is None
    assert POLICIES.build({"name": "edf", "admission_control": False}).reject_after(request, arrival) is None


@settings(max_examples=300, deadline=None)
@given(arrival=st.floats(0, 1e9), max_wait=st.floats(1e-3, 1e4), offset=st.floats(-1e-3, 1e-3))
def test_sjf_priority_changes_at_is_never_later_than_the_promotion(arrival, max_wait, offset):
    sjf = POLICIES.build({"name": "sjf", "max_wait": max_wait})
    request = make_request("r", arrival=arrival)
    at = sjf.priority_changes_at(request, arrival)
    before = sjf.priority(request, arrival)
    edge = arrival + max_wait
    for now in (at, math.nextafter(at, -math.inf), edge + offset, edge, math.nextafter(edge, math.inf)):
        if now >= arrival and sjf.priority(request, now) != before:
            assert now >= at
            assert sjf.priority_changes_at(request, now) is None   # promoted for good
    assert POLICIES.build("sjf").priority_changes_at(request, arrival) is None   # pure SJF never changes


def test_the_documented_timed_policy_declares_honestly_and_serves_as_the_full_resort():
    """The aging example of docs/policy_library.md ("The waiting queue's cost"), run as a user would write it."""
    text = (REPO / "docs" / "policy_library.md").read_text()
    start = text.index("```python\nfrom nanovllm import Policy, a_hair_before") + len("```python\n")
    snippet = text[start:text.index("```", start)]
    namespace: dict = {}
    exec(snippet.replace("@register_policy(", "@(lambda name: lambda cls: cls)("), namespace)   # not registered
    cls = namespace["ShortestPromptFirstTimed"]
    assert cls.waiting_key == "timed"
    reference = resorted_every_step(cls)(max_wait=6.0)
    log = _KeyLog(reference)
    assert _serve(cls(max_wait=6.0)).requests == _serve(reference).requests
    _assert_declaration_holds(log, timed=True)
