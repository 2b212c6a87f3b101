"""``vllm_v1``: vLLM V1's scheduling rules in counted tokens, on a bare scheduler (no model, no clock): one token
budget per step, split running requests first (decodes, then the rest of a chunked prefill), then admissions
FCFS, the last chunked to what is left; ``max_num_seqs``; recompute preemption of the latest arrival."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from helpers import REPO, bare_scheduler, make_request, run_step
from nanovllm import POLICIES
from nanovllm.request import RequestStatus

POLICY = {"name": "vllm_v1", "max_num_batched_tokens": 16, "max_num_seqs": 3}


def _plan(out) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


def test_defaults_are_vllm_cpu_api_server_defaults_and_the_hydra_config():
    config = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "scheduler" / "vllm_v1.yaml"))
    built = POLICIES.build("vllm_v1")
    assert config == {"name": "vllm_v1", "max_num_batched_tokens": built.max_num_batched_tokens,
                      "max_num_seqs": built.max_num_seqs}
    assert (built.max_num_batched_tokens, built.max_num_seqs) == (2048, 128)


@pytest.mark.parametrize("field, value", [("max_num_batched_tokens", 0), ("max_num_seqs", 0),
                                          ("max_num_batched_tokens", 2.0), ("max_num_seqs", True)])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"scheduler.{field}"):
        POLICIES.build({"name": "vllm_v1", field: value})


def test_one_budget_per_step_running_first_then_fcfs_admissions_chunked_to_what_is_left():
    scheduler = bare_scheduler(POLICY, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    scheduler.add(make_request("a", 40, max_tokens=8, arrival=0.0), 0.0)
    # The engine allows 64 tokens a step; vLLM's budget of 16 chunks the 40-token prompt 16 + 16 + 8.
    assert [_plan(run_step(scheduler, t)[0]) for t in (0, 1, 2)] == [[("a", 16)], [("a", 16)], [("a", 8)]]
    scheduler.add(make_request("b", 30, max_tokens=8, arrival=3.0), 3.0)
    scheduler.add(make_request("c", 30, max_tokens=8, arrival=3.5), 3.5)
    # a decodes first; b (the earlier arrival) takes the 15 tokens left and c waits for a budget.
    assert _plan(run_step(scheduler, 4)[0]) == [("a", 1), ("b", 15)]
    # b's chunk is running work: it goes before c's admission, which gets none of the budget.
    assert _plan(run_step(scheduler, 5)[0]) == [("a", 1), ("b", 15)]
    # b now decodes; c is admitted with the 14 tokens left, then finishes its prompt behind two decodes.
    assert _plan(run_step(scheduler, 6)[0]) == [("a", 1), ("b", 1), ("c", 14)]
    assert _plan(run_step(scheduler, 7)[0]) == [("a", 1), ("b", 1), ("c", 14)]
    assert _plan(run_step(scheduler, 8)[0]) == [("a", 1), ("b", 1), ("c", 2)]
    assert _plan(run_step(scheduler, 9)[0]) == [("a", 1), ("b", 1), ("c", 1)]


def test_max_num_seqs_caps_the_running_batch_below_the_engine_cap():
    scheduler = bare_scheduler(POLICY, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(5):
        scheduler.add(make_request(f"r{i}", 2, max_tokens=2, arrival=float(i)), float(i))
    out, _ = run_step(scheduler, 5)
    # Budget for all five (10 tokens of 16) and blocks too: only max_num_seqs = 3 run, in arrival order.
    assert _plan(out) == [("r0", 2), ("r1", 2), ("r2", 2)]
    assert [r.request_id for r in scheduler.waiting] == ["r3", "r4"]


def test_blocks_running_out_preempt_the_latest_arrival_by_recompute_and_it_is_readmitted_first():
    # 6 blocks of 4 tokens: two 8-token prompts decoding 12 tokens each outgrow them.
    scheduler = bare_scheduler(POLICY, num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    scheduler.add(make_request("early", 8, max_tokens=12, arrival=0.0), 0.0)
    scheduler.add(make_request("late", 8, max_tokens=12, arrival=1.0), 1.0)
    scheduler.add(make_request("later", 4, max_tokens=12, arrival=2.0), 2.0)
    for t in range(2, 40):
        out, _ = run_step(scheduler, t)
        if out.preempted:
            break
    else:
        pytest.fail("the cache never ran out")
    # The victim is the latest arrival running ('later' never got blocks); it lost every computed token.
    assert [r.request_id for r in out.preempted] == ["late"]
    victim = out.preempted[0]
    assert victim.num_computed_tokens == 0 and victim.status == RequestStatus.PREEMPTED
    # No admission in a step that preempted.
    assert _plan(out) == [("early", 1)]
    # Readmitted ahead of 'later', which had waited in the queue all along (vLLM prepends a preempted request),
    # and its whole sequence is computed again: 8 prompt tokens and the 5 it had generated.
    while not any(r is victim for r, _ in out.scheduled):
        t += 1
        out, _ = run_step(scheduler, t)
    assert [r.request_id for r, _ in out.scheduled][0] == "late"
    assert _plan(out)[0] == ("late", 13)
