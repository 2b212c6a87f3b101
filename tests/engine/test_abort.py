"""Aborting requests: a waiting or running request ends aborted with its blocks freed at once, the policy hears
it, the others go on with the tokens they would have produced anyway; unknown ids are a harmless no-op."""

from __future__ import annotations

import pytest

from helpers import bare_scheduler, make_request, run_step
from nanovllm import ALLOCATORS, LLM, POLICIES, Policy, RequestStatus, SamplingParams
from nanovllm.engine.scheduler import Scheduler


class Recording(Policy):
    registered_name = "recording"

    def __init__(self) -> None:
        self.finished: list[str] = []

    def on_finish(self, request, now):
        self.finished.append(request.request_id)


@pytest.mark.parametrize("allocator", ALLOCATORS.names())
def test_abort_a_running_request_frees_its_blocks_at_once(allocator):
    policy = Recording()
    scheduler = Scheduler(policy, ALLOCATORS.get(allocator)(32, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_request("a", 9), make_request("b", 6, start=50)
    scheduler.add(a, 0.0)
    scheduler.add(b, 0.0)
    out = scheduler.schedule(0.0)
    scheduler.update_from_output(out, [7, 7], 0.0, max_model_len=10**9)
    free_before = scheduler.allocator.num_free_blocks()
    held = len(a.block_table)
    assert held >= 3 and a.status is RequestStatus.RUNNING  # contiguous reserves prompt + max_tokens

    assert scheduler.abort("a", 1.0) is a
    assert a.status is RequestStatus.ABORTED and a.finish_reason == "abort" and a.error == "aborted"
    assert a.finish_time == 1.0 and a.is_finished and not a.block_table
    assert scheduler.allocator.num_free_blocks() == free_before + held
    assert policy.finished == ["a"] and scheduler.running == [b]
    # Reported once, by the next update, like a rejected request; b goes on.
    out = scheduler.schedule(2.0)
    assert [r for r, _ in out.scheduled] == [b]
    ended = scheduler.update_from_output(out, [7], 2.0, max_model_len=10**9)
    assert ended[0] is a and a not in scheduler.update_from_output(scheduler.schedule(3.0), [7], 3.0, 10**9)


def test_abort_a_waiting_request_and_unknown_or_ended_ids_are_no_ops():
    scheduler = Scheduler(POLICIES.build("fcfs"), ALLOCATORS.get("paged")(8, 4), max_num_seqs=1,
                          max_num_batched_tokens=64)
    first, queued = make_request("first", 4, max_tokens=1), make_request("queued", 4)
    scheduler.add(first, 0.0)
    scheduler.add(queued, 0.0)
    out = scheduler.schedule(0.0)                      # one seat: "queued" waits
    assert scheduler.abort("queued", 0.5) is queued and queued.status is RequestStatus.ABORTED
    assert scheduler.waiting == []
    assert scheduler.update_from_output(out, [7], 1.0, 10**9) == [queued, first]
    assert scheduler.abort("first", 2.0) is None       # already finished
    assert scheduler.abort("nobody", 2.0) is None
    assert first.status is RequestStatus.FINISHED and first.finish_reason == "length"
    assert scheduler.allocator.num_free_blocks() == 8 and not scheduler.has_unfinished()


def test_abort_keeps_prefix_cached_blocks_reusable():
    scheduler = Scheduler(POLICIES.build("fcfs"), ALLOCATORS.get("prefix")(16, 4), max_num_seqs=4,
                          max_num_batched_tokens=64)
    a = make_request("a", 8)
    scheduler.add(a, 0.0)
    out = scheduler.schedule(0.0)
    scheduler.update_from_output(out, [7], 0.0, 10**9)
    scheduler.abort("a", 1.0)
    assert scheduler.allocator.num_free_blocks() == 16
    twin = make_request("twin", 8)
    scheduler.add(twin, 1.0)
    scheduler.schedule(1.0)
    assert twin.num_cached_tokens == 4  # the full first block is a hit (a whole prompt is never matched)


def test_engine_abort_request_mid_run_others_finish_with_their_reference_tokens(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    alone = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    requests = [engine.make_request(p, params, request_id=f"abort-test-{i}") for i, p in enumerate(prompts)]
    for r in requests:
        engine.add_request(r)
    engine.step()
    engine.step()
    used = engine.allocator.num_used_blocks()
    assert engine.abort_request("abort-test-1") is True
    assert engine.allocator.num_used_blocks() < used
    assert engine.abort_request("abort-test-1") is False      # already aborted
    assert engine.abort_request("no-such-request") is False
    ended = []
    while engine.has_unfinished():
        ended.extend(engine.step().finished)
    assert sorted(r.request_id for r in ended) == ["abort-test-0", "abort-test-1", "abort-test-2"]
    aborted = requests[1]
    assert aborted.finish_reason == "abort" and aborted.status is RequestStatus.ABORTED
    assert 0 < aborted.num_output_tokens < 6
    assert aborted.output_token_ids == alone[1][: aborted.num_output_tokens]
    assert [requests[0].output_token_ids, requests[2].output_token_ids] == [alone[0], alone[2]]
    assert engine.allocator.num_free_blocks() == engine.allocator.num_blocks


def test_an_interrupted_generate_leaves_the_engine_clean_and_usable():
    class InterruptOnThirdStep(Policy):
        registered_name = "interrupt_on_third_step"

        def __init__(self) -> None:
            self.steps = 0

        def on_step(self, scheduled, now):
            self.steps += 1
            if self.steps == 3:
                raise KeyboardInterrupt

    llm = LLM(scheduler=InterruptOnThirdStep(), num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Hello there", "The sky is"], params, use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished() and engine.allocator.num_free_blocks() == engine.allocator.num_blocks
    [out] = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert out.finish_reason == "length" and len(out.token_ids) == 2


# -- aborting a request that holds no blocks ---------------------------------------------------------------------------

@pytest.mark.parametrize("allocator", ["paged", "contiguous", "prefix", "radix"])
def test_aborting_a_request_that_never_got_blocks_frees_nothing_and_reports_it(allocator):
    scheduler = bare_scheduler(POLICIES.build("fcfs"), num_blocks=8, allocator=allocator)
    scheduler.add(make_request("running", prompt=8, max_tokens=8), 0.0)
    run_step(scheduler, 0.0)
    used, free = scheduler.allocator.num_used_blocks(), scheduler.allocator.num_free_blocks()
    scheduler.add(make_request("never-admitted"), 0.5)
    assert scheduler.abort("never-admitted", 0.5).status is RequestStatus.ABORTED
    assert (scheduler.allocator.num_used_blocks(), scheduler.allocator.num_free_blocks()) == (used, free)
    _, finished = run_step(scheduler, 1.0)
    assert [r.request_id for r in finished] == ["never-admitted"] and scheduler.running[0].request_id == "running"
