"""Priority scheduling's pieces: the policy names, a request's rank, and the waiting heap.

Under ``"priority"`` a request's rank is ``(priority, request_id)``: lower priority values first,
ties in arrival order (``InputProcessor`` hands out the ids as it builds requests, a group's
samples right after their first). The scheduler keeps its waiting queue in ``WaitingHeap`` and its
running list sorted by rank, so the lowest-ranked running request, the one preempted first, is
always the last.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Literal

from asyncllm.core._request import Request

SchedulingPolicy = Literal["fcfs", "priority"]
"""``"fcfs"``: first come, first served (requests' ``priority`` must be 0). ``"priority"``: lower
``priority`` values first, ties first come, first served; an outranked running request is
preempted to admit a waiting one."""

SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


def rank(request: Request) -> tuple[int, int]:
    """Where ``request`` stands under the priority policy: smaller goes first."""
    return (request.priority, request.request_id)


class WaitingHeap:
    """The waiting queue of the priority policy: ``rank`` order, O(log n) to add, pop or remove.

    It answers the part of ``deque``'s interface the scheduler uses, so either can be its queue.
    ``append`` and ``appendleft`` are the same: a request's place is its rank, so a preempted
    request goes back ahead of every later arrival of its priority, as FCFS puts it at the front.
    Removing is lazy (the entry stays until it reaches the top, then is dropped); the heap is
    rebuilt when such entries outnumber live ones, so aborts of requests that never come up (a low
    priority under steady high-priority load) cannot grow it without bound.
    """

    def __init__(self) -> None:
        # (priority, request id, sequence, request); the sequence is unique, so two entries are
        # never compared by their requests, and it tells a live entry from a removed one.
        self._heap: list[tuple[int, int, int, Request]] = []
        self._live: dict[int, int] = {}  # request id -> the sequence of its live entry
        self._sequence = itertools.count()

    def append(self, request: Request) -> None:
        """Queue ``request`` at its rank.

        Raises:
            ValueError: It is queued already (a request waits once).
        """
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id} is already waiting")
        sequence = next(self._sequence)
        self._live[request.request_id] = sequence
        heapq.heappush(self._heap, (*rank(request), sequence, request))

    appendleft = append

    def __getitem__(self, index: int) -> Request:
        """The first request (only index 0: the scheduler only ever looks at the head).

        Raises:
            IndexError: The queue is empty, or ``index`` is not 0.
        """
        if index != 0:
            raise IndexError("a WaitingHeap only shows its first request")
        self._drop_removed()
        if not self._heap:
            raise IndexError("no request is waiting")
        return self._heap[0][3]

    def popleft(self) -> Request:
        """Take the first request out.

        Raises:
            IndexError: The queue is empty.
        """
        first = self[0]
        heapq.heappop(self._heap)
        del self._live[first.request_id]
        return first

    def remove(self, request: Request) -> None:
        """Take ``request`` out, wherever it stands.

        Raises:
            ValueError: It is not waiting.
        """
        if request not in self:
            raise ValueError(f"request {request.request_id} is not waiting")
        del self._live[request.request_id]
        if len(self._heap) > 2 * len(self._live) + 64:  # mostly removed entries: rebuild
            self._heap = [entry for entry in self._heap if self._is_live(entry)]
            heapq.heapify(self._heap)

    def __contains__(self, request: object) -> bool:
        return isinstance(request, Request) and request.request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request in rank order (sorts: for inspection and tests, not per step)."""
        return iter([entry[3] for entry in sorted(self._heap) if self._is_live(entry)])

    def _is_live(self, entry: tuple[int, int, int, Request]) -> bool:
        return self._live.get(entry[1]) == entry[2]

    def _drop_removed(self) -> None:
        while self._heap and not self._is_live(self._heap[0]):
            heapq.heappop(self._heap)
