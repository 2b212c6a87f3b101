"""The scheduler's waiting queue: waiting requests in the policy's order, kept at the cost the policy declares.

The scheduler used to append each request entering the waiting queue to a list and re-sort the whole list with
a stable sort at every step, asking ``Policy.priority`` of every waiting request, and ``reject_reason`` too: with
100,000 requests waiting that scan was a step's whole cost. A ``WaitingQueue`` gives the same order at the cost
``Policy.waiting_key`` declares (``waiting_queue_for`` picks the structure):

* ``KeyedQueue`` ("static" and "timed" keys): a heap on the key computed when a request enters; a "timed" key is
  recomputed when the time ``Policy.priority_changes_at`` named has come (a timer heap). O(log n) per entry,
  admission and key change, nothing per step.
* ``ResortingQueue`` ("dynamic"): the old list, re-sorted at every ordering. Exact; O(n log n) per step.
* ``WindowQueue`` ("dynamic" with ``Policy.waiting_window`` = W): requests in arrival order, of which only the
  first W are ranked by ``priority`` at each ordering. An approximation the policy declares; O(W log n) per step.

Each keeps the old list's order exactly (for "static" and "timed" keys, and "dynamic" without a window):

* a request entering between two orderings waits after the ordered ones, in entry order, until the next
  ``order(now)`` puts it in place, as an appended list item waited for the next sort;
* requests with equal keys keep the order they had, as a stable sort keeps it: for keys that never changed,
  the order of entry (``_Rank`` keeps it for keys that did change).

Rejections: with ``Policy.rejection == "timed"`` a timer heap on ``Policy.reject_after`` tells which requests
``reject_reason`` must be asked of at a step (``due_for_rejection``), in the order the old per-step scan met them.
Removed requests leave their heap items behind, skipped when met and dropped when they outnumber the live ones.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from nanovllm.policy import WAITING_KEYS, Policy, PolicyError
from nanovllm.request import Request

# ``Scheduler._ask``: calls a policy method by name; any exception it raises becomes a PolicyError.
Ask = Callable[..., Any]
KeyFunction = Callable[[Request, float], Any]


class _Rank:
    """Where an entry stands among entries with an equal key, as a stable re-sort at every ordering would have
    left it: ``since`` is the ordering at which its key took its current value, ``prev`` its rank before that
    (None: it entered at ``since``, so it came after every request already ordered, in entry order ``seq``).

    A stable sort breaks a tie by the order at the previous ordering, which was by the keys then in force: so of
    two entries with an equal key, the one that had it first is ahead unless the other's previous key was
    smaller; two that took it at the same ordering go by their previous keys, then by their previous ranks."""

    __slots__ = ("key", "since", "seq", "prev")

    def __init__(self, key: Any, since: int, seq: int, prev: _Rank | None) -> None:
        self.key, self.since, self.seq, self.prev = key, since, seq, prev

    def __lt__(self, other: _Rank) -> bool:
        # Called only for equal keys: heaps and sorts compare (key, rank).
        a, b = self, other
        while True:
            if a.since < b.since:   # at b's ordering a already had this key; b was new, or held b.prev.key
                return b.prev is None or a.key < b.prev.key
            if b.since < a.since:
                return a.prev is not None and a.prev.key < b.key
            if a.prev is None and b.prev is None:   # both entered at this ordering: entry order
                return a.seq < b.seq
            if a.prev is None or b.prev is None:    # an entry already ordered goes before a new one
                return b.prev is None
            if a.prev.key != b.prev.key:            # both changed key here: the order their old keys gave
                return a.prev.key < b.prev.key
            a, b = a.prev, b.prev


@dataclass(eq=False, slots=True)
class _Entry:
    """One stay of a request in the waiting queue (a request preempted later comes back as a new entry)."""

    request: Request
    seq: int                       # entry order: a tie between equal keys goes by it
    alive: bool = True             # False once it left (admitted, aborted, rejected)
    ordered: bool = False          # placed by an ordering (False: it waits, in entry order, for the next one)
    key: Any = None
    rank: _Rank | None = None
    timer: int = -1                # tick of its live priority_changes_at timer (older ones are stale)
    reject_timer: int = -1         # tick of its live reject_after timer


class _Timers:
    """A heap of (time, tick, entry): the entries whose time has come, in time order. Each entry has at most one
    live timer of a kind (the one whose tick it holds in ``attr``); the rest are stale and skipped."""

    def __init__(self, attr: str) -> None:
        self._attr = attr
        self._heap: list[tuple[float, int, _Entry]] = []
        self._ticks = itertools.count()

    def arm(self, entry: _Entry, time: Any, method: str, policy_name: str, num_live: int) -> None:
        """Set ``entry``'s timer to ``time`` (what the policy's ``method`` answered; None: no timer)."""
        if time is None:
            setattr(entry, self._attr, -1)
            return
        if isinstance(time, bool) or not isinstance(time, (int, float)) or time != time:
            raise PolicyError(f"policy {policy_name!r}: {method} must return a time in seconds or None, got "
                              f"{time!r}")
        tick = next(self._ticks)
        setattr(entry, self._attr, tick)
        heapq.heappush(self._heap, (float(time), tick, entry))
        if len(self._heap) > 2 * num_live + 64:   # drop the timers of entries that left or were re-armed
            self._heap = [item for item in self._heap if self._live(item)]
            heapq.heapify(self._heap)

    def pop_due(self, now: float) -> list[_Entry]:
        """The live entries whose time is ``now`` or earlier, in time order; their timers are spent."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            item = heapq.heappop(self._heap)
            if self._live(item):
                due.append(item[2])
        return due

    def _live(self, item: tuple[float, int, _Entry]) -> bool:
        return item[2].alive and getattr(item[2], self._attr) == item[1]


class WaitingQueue(ABC):
    """The waiting requests in the policy's order: ``Scheduler.waiting``.

    The scheduler calls ``push`` when a request enters the waiting queue (it arrives, or is preempted),
    ``order(now)`` where it used to re-sort (at the start of each step and after each preemption for a waiting
    request), ``head``/``pop`` to admit, ``remove`` for an abort or rejection, and ``due_for_rejection`` at the
    start of each step when the policy's rejections are timed. Readers (the engine's records, the server's
    gauges, the live dashboard) use ``len``, ``in``, iteration in order and ``waiting[:n]`` (the first n);
    a WaitingQueue equals the list of its requests in order.
    """

    def __init__(self, ask: Ask, policy_name: str, timed_rejections: bool = False) -> None:
        self._ask = ask
        self._policy_name = policy_name
        self._entries: dict[int, _Entry] = {}             # id(request) -> its entry, while it waits
        self._by_request_id: dict[str, list[_Entry]] = {}  # for abort by id
        self._pending: list[_Entry] = []                 # entered since the last ordering, in entry order
        self._pending_start = 0                          # pending[:start] were popped (an empty ordered part)
        self._seq = itertools.count()
        self._timed_rejections = timed_rejections
        self._unarmed: list[_Entry] = []                 # entries to ask reject_after of at the next step
        self._reject_timers = _Timers("reject_timer")

    # -- changes (the scheduler) -------------------------------------------------------------------------------
    def push(self, request: Request) -> None:
        """``request`` entered the waiting queue: it waits after the ordered requests until the next ``order``."""
        if id(request) in self._entries:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        entry = _Entry(request, next(self._seq))
        self._entries[id(request)] = entry
        self._by_request_id.setdefault(request.request_id, []).append(entry)
        self._pending.append(entry)
        if self._timed_rejections:
            self._unarmed.append(entry)

    def order(self, now: float) -> None:
        """Put the requests that entered since the last ordering in place and bring every key up to ``now``:
        afterwards the queue's order is that of a stable sort by ``priority(request, now)``."""
        entries = [e for e in self._pending[self._pending_start:] if e.alive]
        self._pending, self._pending_start = [], 0
        self._order(entries, now)
        for entry in entries:
            entry.ordered = True

    def head(self) -> Request | None:
        """The first request in order (None if none waits)."""
        entry = self._ordered_head() or self._pending_head()
        return entry.request if entry is not None else None

    def pop(self) -> Request:
        """Remove and return the first request in order (it is being admitted)."""
        entry = self._ordered_head()
        if entry is not None:
            self._pop_ordered()
        else:
            entry = self._pending_head()
            if entry is None:
                raise IndexError("pop from an empty waiting queue")
            self._pending_start += 1
        self._forget(entry)
        return entry.request

    def remove(self, request: Request) -> None:
        """Take ``request`` out of the queue wherever it stands (aborted or rejected); ValueError if absent."""
        entry = self._entries.get(id(request))
        if entry is None:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        self._forget(entry)
        if entry.ordered:
            self._discard(entry)

    def due_for_rejection(self, now: float) -> list[Request]:
        """The requests ``reject_reason`` must be asked of at ``now``: those whose ``reject_after`` time has come,
        in queue order (the order in which the old per-step scan asked them). A request asked and kept waiting
        is asked ``reject_after`` again at the next step."""
        for entry in self._unarmed:
            if entry.alive:
                time = self._ask("reject_after", entry.request, now)
                self._reject_timers.arm(entry, time, "reject_after", self._policy_name, len(self))
        due = self._reject_timers.pop_due(now)
        self._unarmed = list(due)
        return [entry.request for entry in self._in_queue_order(due)]

    # -- reading -----------------------------------------------------------------------------------------------
    def find(self, request_id: str) -> Request | None:
        """The waiting request with this id (the first in order if several share it), or None."""
        entries = self._by_request_id.get(request_id)
        if not entries:
            return None
        return (entries[0] if len(entries) == 1 else self._in_queue_order(entries)[0]).request

    def first(self, n: int) -> list[Request]:
        """The first ``n`` requests in order, without ordering the rest."""
        found = self._first_ordered(n) if n > 0 else []
        pending = (e.request for e in self._pending[self._pending_start:] if e.alive)
        return found + list(itertools.islice(pending, max(0, n - len(found))))

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, request: object) -> bool:
        return id(request) in self._entries

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in order (sorting a heap's live items: O(n log n))."""
        pending = [e.request for e in self._pending[self._pending_start:] if e.alive]
        return iter([*self._iter_ordered(), *pending])

    def __getitem__(self, index: int | slice) -> Any:
        """``waiting[i]`` and ``waiting[:n]`` as on the old list; a prefix costs what ``first`` costs."""
        if isinstance(index, slice):
            start, stop, step = index.start or 0, index.stop, index.step
            if stop is not None and start >= 0 and stop >= 0 and step in (None, 1):
                return self.first(stop)[start:]
            return list(self)[index]
        if index >= 0:
            found = self.first(index + 1)
            if len(found) > index:
                return found[index]
            raise IndexError("waiting queue index out of range")
        return list(self)[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, WaitingQueue)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None   # type: ignore[assignment]   # mutable, compared by content

    def __repr__(self) -> str:
        return f"{type(self).__name__}({[r.request_id for r in self.first(8)]}{' ...' if len(self) > 8 else ''})"

    # -- what each structure provides --------------------------------------------------------------------------
    @abstractmethod
    def _order(self, entries: list[_Entry], now: float) -> None:
        """Place ``entries`` (live, in entry order) and bring the ordered part up to ``now``."""

    @abstractmethod
    def _ordered_head(self) -> _Entry | None:
        """The first live entry of the ordered part."""

    @abstractmethod
    def _pop_ordered(self) -> None:
        """Drop the entry ``_ordered_head`` returned."""

    @abstractmethod
    def _discard(self, entry: _Entry) -> None:
        """``entry`` (ordered, already dead) left from anywhere in the ordered part."""

    @abstractmethod
    def _iter_ordered(self) -> Iterable[Request]:
        """The ordered part's requests in order."""

    @abstractmethod
    def _first_ordered(self, n: int) -> list[Request]:
        """The ordered part's first ``n`` requests."""

    @abstractmethod
    def _ordered_position(self, entries: list[_Entry]) -> Callable[[_Entry], Any]:
        """A sort key giving the place of each of ``entries`` (all ordered) in the ordered part."""

    # -- shared ------------------------------------------------------------------------------------------------
    def _pending_head(self) -> _Entry | None:
        while self._pending_start < len(self._pending):
            entry = self._pending[self._pending_start]
            if entry.alive:
                return entry
            self._pending_start += 1
        return None

    def _forget(self, entry: _Entry) -> None:
        entry.alive = False
        del self._entries[id(entry.request)]
        same_id = self._by_request_id[entry.request.request_id]
        same_id.remove(entry)
        if not same_id:
            del self._by_request_id[entry.request.request_id]

    def _in_queue_order(self, entries: list[_Entry]) -> list[_Entry]:
        """``entries`` in queue order: the ordered ones by their place, then the pending ones by entry."""
        if len(entries) < 2:
            return list(entries)
        ordered = [e for e in entries if e.ordered]
        position = self._ordered_position(ordered)
        try:
            ordered.sort(key=position)
        except TypeError as exc:
            raise self._incomparable(exc) from exc
        return ordered + sorted((e for e in entries if not e.ordered), key=lambda e: e.seq)

    def _incomparable(self, exc: TypeError) -> PolicyError:
        return PolicyError(f"policy {self._policy_name!r}: priority keys are not comparable: {exc}")


class KeyedQueue(WaitingQueue):
    """Keys fixed while a request waits ("static"), or fixed between the times the policy names ("timed"): a
    heap of (key, rank, entry) on the key computed when the request was ordered.

    ``key`` is the policy's ``priority`` unless given (``WindowQueue`` keys on arrival time)."""

    def __init__(self, ask: Ask, policy_name: str, timed: bool = False, timed_rejections: bool = False,
                 key: KeyFunction | None = None) -> None:
        super().__init__(ask, policy_name, timed_rejections)
        self._key: KeyFunction = key or (lambda request, now: ask("priority", request, now))
        self._timed = timed
        self._heap: list[tuple[Any, _Rank, _Entry]] = []
        self._key_timers = _Timers("timer")
        self._orderings = 0

    def _order(self, entries: list[_Entry], now: float) -> None:
        self._orderings += 1
        if self._timed:   # first the keys whose time has come, so a key changes at most once per ordering
            for entry in self._key_timers.pop_due(now):
                key = self._key(entry.request, now)
                if key != entry.key:
                    entry.key, entry.rank = key, _Rank(key, self._orderings, entry.seq, entry.rank)
                    self._push(entry)
                self._arm(entry, now)
        for entry in entries:
            entry.key = self._key(entry.request, now)
            entry.rank = _Rank(entry.key, self._orderings, entry.seq, None)
            self._push(entry)
            if self._timed:
                self._arm(entry, now)

    def _arm(self, entry: _Entry, now: float) -> None:
        time = self._ask("priority_changes_at", entry.request, now)
        self._key_timers.arm(entry, time, "priority_changes_at", self._policy_name, len(self))

    def _push(self, entry: _Entry) -> None:
        assert entry.rank is not None  # every entry is keyed and ranked before it enters the heap
        try:
            heapq.heappush(self._heap, (entry.key, entry.rank, entry))
        except TypeError as exc:
            raise self._incomparable(exc) from exc
        if len(self._heap) > 2 * len(self) + 64:   # more stale items than live ones: rebuild from the live
            self._heap = [item for item in self._heap if self._live(item)]
            heapq.heapify(self._heap)

    @staticmethod
    def _live(item: tuple[Any, _Rank, _Entry]) -> bool:
        return item[2].alive and item[2].rank is item[1]

    def _ordered_head(self) -> _Entry | None:
        heap = self._heap
        try:
            while heap and not self._live(heap[0]):
                heapq.heappop(heap)
        except TypeError as exc:
            raise self._incomparable(exc) from exc
        return heap[0][2] if heap else None

    def _pop_ordered(self) -> None:
        heapq.heappop(self._heap)

    def _discard(self, entry: _Entry) -> None:
        pass   # its heap item is stale now: skipped when met, dropped when stale items outnumber live ones

    def _iter_ordered(self) -> Iterable[Request]:
        try:
            return [item[2].request for item in sorted(i for i in self._heap if self._live(i))]
        except TypeError as exc:
            raise self._incomparable(exc) from exc

    def _first_ordered(self, n: int) -> list[Request]:
        # Walk the heap as a tree from its root: a node's children are never smaller, so the smallest node of
        # the frontier is the next in order. O(n log n) for the first n, whatever the heap's size.
        heap = self._heap
        found: list[Request] = []
        frontier = [(heap[0], 0)] if heap else []
        try:
            while frontier and len(found) < n:
                item, index = heapq.heappop(frontier)
                if self._live(item):
                    found.append(item[2].request)
                for child in (2 * index + 1, 2 * index + 2):
                    if child < len(heap):
                        heapq.heappush(frontier, (heap[child], child))
        except TypeError as exc:
            raise self._incomparable(exc) from exc
        return found

    def _ordered_position(self, entries: list[_Entry]) -> Callable[[_Entry], Any]:
        return lambda entry: (entry.key, entry.rank)


class ResortingQueue(WaitingQueue):
    """Keys that may change at any step ("dynamic"), exact: the list re-sorted with a stable sort at every
    ordering, ``priority`` asked of every waiting request. O(n log n) per step: the scheduler's old behaviour.
    The list holds the requests themselves, as the old one did (entries would add a memory access per request
    to every sort, a tenth of its time at 100,000 waiting)."""

    def __init__(self, ask: Ask, policy_name: str, timed_rejections: bool = False) -> None:
        super().__init__(ask, policy_name, timed_rejections)
        self._list: list[Request] = []

    def _order(self, entries: list[_Entry], now: float) -> None:
        self._list.extend(entry.request for entry in entries)
        try:  # sort calls the key once per request
            self._list.sort(key=lambda request: self._ask("priority", request, now))
        except TypeError as exc:
            raise self._incomparable(exc) from exc

    def _ordered_head(self) -> _Entry | None:
        return self._entries[id(self._list[0])] if self._list else None

    def _pop_ordered(self) -> None:
        del self._list[0]

    def _discard(self, entry: _Entry) -> None:
        self._list.remove(entry.request)

    def _iter_ordered(self) -> Iterable[Request]:
        return list(self._list)

    def _first_ordered(self, n: int) -> list[Request]:
        return self._list[:n]

    def _ordered_position(self, entries: list[_Entry]) -> Callable[[_Entry], Any]:
        wanted = {id(e.request) for e in entries}
        index = {id(r): i for i, r in enumerate(self._list) if id(r) in wanted}
        return lambda entry: index[id(entry.request)]


class WindowQueue(KeyedQueue):
    """Keys that may change at any step, ranked in a bounded window (``Policy.waiting_window`` = ``size``): the
    requests in arrival order (a heap on (arrival time,), ties by entry), of which the first ``size`` are ranked
    by ``priority`` at every ordering; the rest wait behind them in arrival order. Exact while at most ``size``
    requests wait, an approximation beyond (the policy declares it). O(size log n) per step."""

    def __init__(self, ask: Ask, policy_name: str, size: int, timed_rejections: bool = False) -> None:
        super().__init__(ask, policy_name, timed_rejections=timed_rejections,
                         key=lambda request, now: (request.arrival_time,))
        self._size = size
        self._window: list[_Entry] = []   # ranked, in order; the arrival-order heap holds the others
        self._window_start = 0            # window[:start] were admitted

    def _order(self, entries: list[_Entry], now: float) -> None:
        for entry in self._window[self._window_start:]:   # back into arrival order, with their old keys and ranks
            if entry.alive:
                self._push(entry)
        super()._order(entries, now)
        window: list[_Entry] = []
        while len(window) < self._size and (head := super()._ordered_head()) is not None:
            super()._pop_ordered()
            window.append(head)
        try:   # a stable sort of a list in arrival order: equal keys go by arrival, then entry
            ranked = [(self._ask("priority", entry.request, now), entry) for entry in window]
            ranked.sort(key=lambda pair: pair[0])
        except TypeError as exc:
            raise self._incomparable(exc) from exc
        self._window, self._window_start = [entry for _, entry in ranked], 0

    def _ordered_head(self) -> _Entry | None:
        while self._window_start < len(self._window):
            entry = self._window[self._window_start]
            if entry.alive:
                return entry
            self._window_start += 1
        return super()._ordered_head()

    def _pop_ordered(self) -> None:
        if self._window_start < len(self._window):
            self._window_start += 1
        else:
            super()._pop_ordered()

    def _discard(self, entry: _Entry) -> None:
        pass   # dead entries in the window are skipped like stale heap items

    def _in_window(self) -> list[_Entry]:
        return [e for e in self._window[self._window_start:] if e.alive]

    def _iter_ordered(self) -> Iterable[Request]:
        return [e.request for e in self._in_window()] + list(super()._iter_ordered())

    def _first_ordered(self, n: int) -> list[Request]:
        found = [e.request for e in self._in_window()[:n]]
        return found + super()._first_ordered(n - len(found)) if len(found) < n else found

    def _ordered_position(self, entries: list[_Entry]) -> Callable[[_Entry], Any]:
        place = {id(e): i for i, e in enumerate(self._in_window())}
        return lambda entry: (0, place[id(entry)]) if id(entry) in place else (1, entry.key, entry.rank)


def waiting_queue_for(policy: Policy, ask: Ask) -> WaitingQueue:
    """The structure ``policy``'s declarations call for (``Policy.waiting_key``, ``waiting_window``,
    ``rejection``); a declaration it cannot honour raises a PolicyError naming the policy."""
    name = policy.registered_name
    key, window = policy.waiting_key, policy.waiting_window
    timed_rejections = policy.rejection == "timed"
    if key not in WAITING_KEYS:
        raise PolicyError(f"policy {name!r}: waiting_key must be one of {', '.join(WAITING_KEYS)}, got {key!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise PolicyError(f"policy {name!r}: waiting_window must be an integer >= 1 or None, got {window!r}")
        if key != "dynamic":
            raise PolicyError(f"policy {name!r}: waiting_window bounds the cost of a 'dynamic' key; this policy's "
                              f"waiting_key is {key!r}, kept in order without one")
        return WindowQueue(ask, name, window, timed_rejections)
    if key == "dynamic":
        return ResortingQueue(ask, name, timed_rejections)
    return KeyedQueue(ask, name, timed=key == "timed", timed_rejections=timed_rejections)
