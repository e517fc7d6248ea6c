"""The scheduler's waiting queue, by scheduling policy (vLLM's ``--scheduling-policy``; no torch).

``fcfs``: arrival order; a preempted or skipped request goes back to the front.
``priority``: by ``(priority, arrival_time)``, lower first (vLLM's rule: a request's
``priority`` field, 0 by default; ties by arrival); a preempted or skipped request goes
back by the same key, so it runs again before later arrivals of its priority.

Both queues take and give ``Request`` objects and iterate in the order they would be
scheduled.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterable, Iterator, Protocol

from pagedllm.config.scheduler import SCHEDULING_POLICIES
from pagedllm.core.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    """The ``priority`` policy's order of ``request``: ``(priority, arrival_time)``, lower first."""
    return request.priority, request.arrival_time


class RequestQueue(Protocol):
    """What the scheduler needs of its waiting queue."""

    def add_request(self, request: Request) -> None: ...
    def peek_request(self) -> Request: ...
    def pop_request(self) -> Request: ...
    def prepend_request(self, request: Request) -> None: ...
    def prepend_requests(self, requests: Iterable[Request]) -> None: ...
    def remove_request(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue(deque):
    """Arrival order (a deque: ``[0]`` is the next request)."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def peek_request(self) -> Request:
        """The next request. Raises ``IndexError`` when empty."""
        return self[0]

    def pop_request(self) -> Request:
        """Take the next request. Raises ``IndexError`` when empty."""
        return self.popleft()

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put ``requests`` back in front, keeping their order."""
        self.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        """Take ``request`` out. Raises ``ValueError`` if it is not queued."""
        self.remove(request)


class PriorityRequestQueue:
    """A heap by ``priority_key`` (then insertion, so equal keys keep their order)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), next(self._counter), request))

    def peek_request(self) -> Request:
        """The next request. Raises ``IndexError`` when empty."""
        return self._heap[0][-1]

    def pop_request(self) -> Request:
        """Take the next request. Raises ``IndexError`` when empty."""
        return heapq.heappop(self._heap)[-1]

    def prepend_request(self, request: Request) -> None:
        """Put back a preempted or skipped request: by its key, as any other."""
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        """Take ``request`` out (O(n)). Raises ``ValueError`` if it is not queued."""
        for index, entry in enumerate(self._heap):
            if entry[-1] is request:
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id} is not in the waiting queue")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue of ``policy`` (one of ``SCHEDULING_POLICIES``).

    Raises:
        ValueError: an unknown policy.
    """
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}.")
