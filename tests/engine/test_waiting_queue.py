"""The waiting queue keeps the old list's order exactly: random entries (arrivals and preemptions), admissions,
aborts, orderings and rejections, over scripted keys with many ties, give the same order, the same head and the
same rejections, in the same order, as the list the scheduler used to append to, re-sort with a stable sort at
every ordering and scan for rejections at every step. Then how a policy's declarations pick the structure, and
the errors a bad declaration gets."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import bare_scheduler, make_request, run_step
from nanovllm import POLICIES, Policy
from nanovllm.engine.scheduler import PolicyError
from nanovllm.engine.waiting_queue import KeyedQueue, ResortingQueue, WindowQueue, waiting_queue_for

EXAMPLES = 100
OPS = 60


class Scripted(Policy):
    """Keys and rejections scripted per stay in the waiting queue: ``changes[request_id]`` is the stay's
    [(time, key), ...] (the key is the last one whose time has come), ``reject_at`` when it is rejected.
    ``priority_changes_at`` and ``reject_after`` answer ``early`` seconds before the truth (allowed: early only
    costs a check). ``waiting_key="dynamic"`` keys ignore the script: they change at every ordering."""

    registered_name = "scripted"

    def __init__(self, waiting_key: str, early: float = 0.0, window: int | None = None) -> None:
        self.waiting_key = waiting_key
        self.waiting_window = window
        self.early = early
        self.changes: dict[str, list[tuple[float, int]]] = {}
        self.reject_at: dict[str, float | None] = {}

    def priority(self, request, now):
        if self.waiting_key == "dynamic":
            return (zlib.crc32(f"{request.request_id}@{now}".encode()) % 3,)
        return (max((t, i, key) for i, (t, key) in enumerate(self.changes[request.request_id]) if t <= now)[2],)

    def priority_changes_at(self, request, now):
        later = [t for t, _ in self.changes[request.request_id] if t > now]
        return min(later) - self.early if later else None

    def reject_reason(self, request, now):
        at = self.reject_at[request.request_id]
        return "too late" if at is not None and now >= at else None

    def reject_after(self, request, now):
        at = self.reject_at[request.request_id]
        return None if at is None else at - self.early


class Reference:
    """The old waiting list: append on entry, stable re-sort at every ordering, a scan for rejections."""

    def __init__(self, policy: Scripted) -> None:
        self.policy = policy
        self.list: list = []
        self.seq: dict[int, int] = {}   # id(request) -> entry number (for the window's arrival order)
        self.count = 0

    def push(self, request) -> None:
        self.list.append(request)
        self.seq[id(request)] = self.count
        self.count += 1

    def order(self, now: float) -> None:
        window = self.policy.waiting_window
        if window is None:
            self.list.sort(key=lambda r: self.policy.priority(r, now))
            return
        fcfs = sorted(self.list, key=lambda r: (r.arrival_time, self.seq[id(r)]))
        self.list = sorted(fcfs[:window], key=lambda r: self.policy.priority(r, now)) + fcfs[window:]

    def reject(self, now: float) -> list:
        rejected = [r for r in self.list if self.policy.reject_reason(r, now)]
        self.list = [r for r in self.list if r not in rejected]
        return rejected


def _script(draw, now: float, timed: bool) -> list[tuple[float, int]]:
    changes = [(float("-inf"), draw(st.integers(0, 2)))]
    if timed:
        for _ in range(draw(st.integers(0, 2))):
            changes.append((now + draw(st.sampled_from([0.0, 0.5, 1.0, 1.5, 3.0])), draw(st.integers(0, 2))))
    return changes


@pytest.mark.parametrize("waiting_key, window", [("static", None), ("timed", None), ("dynamic", None),
                                                 ("dynamic", 3)])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_queue_keeps_the_order_of_a_stable_resort_of_the_old_list(waiting_key, window, data):
    draw = data.draw
    policy = Scripted(waiting_key, early=draw(st.sampled_from([0.0, 0.25, 2.0])), window=window)
    queue = waiting_queue_for(policy, lambda method, *args: getattr(policy, method)(*args))
    assert type(queue) is {"static": KeyedQueue, "timed": KeyedQueue, "dynamic": ResortingQueue}[waiting_key] \
        if window is None else type(queue) is WindowQueue
    ref, running, now, made = Reference(policy), [], 0.0, 0

    def enter(request) -> None:
        policy.changes[request.request_id] = _script(draw, now, timed=waiting_key == "timed")
        policy.reject_at[request.request_id] = draw(st.one_of(st.none(), st.sampled_from([now, now + 1.0,
                                                                                          now + 2.5])))
        queue.push(request)
        ref.push(request)

    for _ in range(OPS):
        op = draw(st.sampled_from(["arrive", "arrive", "admit", "preempt", "abort", "step", "order"]))
        if op == "arrive":
            made += 1
            enter(make_request(f"r{made}", arrival=now - draw(st.sampled_from([0.0, 0.0, 1.0, 2.0]))))
        elif op == "admit" and ref.list:
            assert queue.head() is ref.list[0]
            admitted = queue.pop()
            assert admitted is ref.list.pop(0)
            running.append(admitted)
        elif op == "preempt" and running:
            enter(running.pop(draw(st.integers(0, len(running) - 1))))
        elif op == "abort" and ref.list:
            request = ref.list.pop(draw(st.integers(0, len(ref.list) - 1)))
            assert queue.find(request.request_id) is request
            queue.remove(request)
            assert request not in queue and queue.find(request.request_id) is None
        elif op == "step":
            now += draw(st.sampled_from([0.0, 0.5, 1.0, 1.5]))
            rejected = [r for r in queue.due_for_rejection(now) if policy.reject_reason(r, now)]
            for request in rejected:
                queue.remove(request)
            assert rejected == ref.reject(now)
            queue.order(now)
            ref.order(now)
        elif op == "order":   # a second ordering at the same time (after a preemption for a waiting request)
            queue.order(now)
            ref.order(now)
        assert list(queue) == ref.list and len(queue) == len(ref.list) and bool(queue) is bool(ref.list)
        assert queue.head() is (ref.list[0] if ref.list else None)
        n = draw(st.integers(0, 5))
        assert queue.first(n) == ref.list[:n] == queue[:n] and all(r in queue for r in ref.list)


def test_window_ranks_only_the_longest_waiting_and_keeps_the_rest_in_arrival_order():
    class Shortest(Policy):
        registered_name = "shortest"
        waiting_window = 2

        def priority(self, request, now):
            return (request.num_prompt_tokens,)

    queue = waiting_queue_for(Shortest(), lambda method, *args: getattr(Shortest(), method)(*args))
    requests = [make_request(f"r{i}", prompt=p, arrival=float(i)) for i, p in enumerate([9, 5, 1, 7, 3])]
    for r in requests:
        queue.push(r)
    queue.order(0.0)
    assert [r.request_id for r in queue] == ["r1", "r0", "r2", "r3", "r4"]   # r0, r1 ranked; the rest by arrival


# -- what the declarations choose ------------------------------------------------------------------------------

def test_every_builtin_policy_declares_its_waiting_key():
    # Built-in only: a test in the same process may have registered a user's policy (experiments/my_policy.py).
    builtin = [name for name in POLICIES.names() if POLICIES.get(name).__module__.startswith(("policies.", "nanovllm."))]
    declared = {name: (POLICIES.build(name).waiting_key, POLICIES.build(name).rejection) for name in builtin}
    assert declared == {"edf": ("static", "timed"), "fair": ("dynamic", "never"), "fcfs": ("static", "never"),
                        "lpm": ("dynamic", "never"), "mlfq": ("static", "never"),
                        "prefill_first": ("static", "never"), "priority": ("static", "never"),
                        "random": ("static", "never"), "sarathi": ("static", "never"), "sjf": ("timed", "never"),
                        "vllm_v1": ("static", "never")}
    assert POLICIES.build({"name": "sjf", "predictor": "client_history"}).waiting_key == "dynamic"
    assert POLICIES.build({"name": "sjf", "predictor": lambda r: 1}).waiting_key == "dynamic"
    assert type(bare_scheduler({"name": "lpm", "waiting_window": 128}).waiting) is WindowQueue
    assert type(bare_scheduler({"name": "fair", "waiting_window": 64}).waiting) is WindowQueue


def test_a_subclass_that_overrides_priority_without_declaring_gets_the_exact_full_resort():
    class Mine(Policy):
        def priority(self, request, now):
            return (-request.num_prompt_tokens,)

    class Declared(Policy):
        waiting_key = "static"

        def priority(self, request, now):
            return (-request.num_prompt_tokens,)

    sjf, priority = type(POLICIES.build("sjf")), type(POLICIES.build("priority"))

    class MySjf(sjf):          # sjf's "timed" is for its own ranking: a new priority does not inherit it
        def priority(self, request, now):
            return (request.num_prompt_tokens,)

    class MyPriority(priority):
        def priority(self, request, now):
            return (-request.priority,)

    class Inherits(priority):
        """The priority it declared for is unchanged: so is the declaration."""

    assert (Mine.waiting_key, Declared.waiting_key, MySjf().waiting_key, MyPriority.waiting_key,
            Inherits.waiting_key) == ("dynamic", "static", "dynamic", "dynamic", "static")
    assert type(bare_scheduler(Mine()).waiting) is ResortingQueue
    assert type(bare_scheduler(MySjf()).waiting) is ResortingQueue
    assert type(bare_scheduler(Declared()).waiting) is KeyedQueue


def test_a_subclass_that_overrides_reject_reason_alone_is_asked_about_every_request_every_step():
    edf = type(POLICIES.build("edf"))

    class Picky(Policy):
        def reject_reason(self, request, now):
            return None

    class StricterEdf(edf):   # a new rule: edf's reject_after does not describe it
        def reject_reason(self, request, now):
            return "no" if request.priority else super().reject_reason(request, now)

    class TimedEdf(StricterEdf):
        def reject_after(self, request, now):
            return 0.0

    assert (Policy.rejection, Picky.rejection, edf.rejection, StricterEdf.rejection, TimedEdf.rejection) == (
        "never", "every_step", "timed", "every_step", "timed")
    asked = []

    class Counting(Policy):
        def reject_reason(self, request, now):
            asked.append(request.request_id)
            return None

    scheduler = bare_scheduler(Counting(), max_num_seqs=1)
    for i in range(3):
        scheduler.add(make_request(f"r{i}", max_tokens=8), 0.0)
    run_step(scheduler, 0.0)
    run_step(scheduler, 1.0)
    assert asked == ["r0", "r1", "r2", "r1", "r2"]


@pytest.mark.parametrize("declare, error", [
    (dict(waiting_key="sorted"), "waiting_key must be one of static, timed, dynamic, got 'sorted'"),
    (dict(waiting_key="static", waiting_window=8), "waiting_window bounds the cost of a 'dynamic' key"),
    (dict(waiting_key="dynamic", waiting_window=0), "waiting_window must be an integer >= 1 or None, got 0"),
])
def test_a_declaration_the_queue_cannot_honour_is_named(declare, error):
    policy = Policy()
    policy.registered_name = "odd"
    for name, value in declare.items():
        setattr(policy, name, value)
    with pytest.raises(PolicyError, match=f"policy 'odd': {error}"):
        bare_scheduler(policy)


def test_a_timer_that_is_not_a_time_and_keys_that_do_not_compare_are_named():
    class Late(Policy):
        registered_name = "late"
        waiting_key = "timed"

        def priority_changes_at(self, request, now):
            return "soon"

    scheduler = bare_scheduler(Late())
    scheduler.add(make_request("a"), 0.0)
    with pytest.raises(PolicyError, match=r"policy 'late': priority_changes_at must return a time in seconds or "
                                          r"None, got 'soon'"):
        scheduler.schedule(0.0)

    class Mixed(Policy):
        registered_name = "mixed"
        waiting_key = "static"

        def priority(self, request, now):
            return (request.request_id,) if request.request_id == "a" else (1,)

    scheduler = bare_scheduler(Mixed())
    for rid in ("a", "b"):
        scheduler.add(make_request(rid), 0.0)
    with pytest.raises(PolicyError, match="policy 'mixed': priority keys are not comparable"):
        scheduler.schedule(0.0)
