"""The waiting queue: one interface, one class per scheduling policy.

A queue's order is the admission order, and the same order picks whom to
preempt: the running request that would be admitted last goes first, so the
policy is stated once.
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from tokenmill.core.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def add_front(self, request: Request) -> None:
        """Queue a preempted request again, ahead of the requests it came before."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to admit (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request to admit (IndexError when empty)."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Take a request out of the queue, wherever it is (ValueError if absent)."""

    @abstractmethod
    def preemption_victim(self, running: list[Request]) -> Request:
        """The running request (in admission order) this policy gives up first."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The queued requests in admission order."""


class FCFSRequestQueue(RequestQueue):
    """First come, first served; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._requests.append(request)

    def add_front(self, request: Request) -> None:
        self._requests.appendleft(request)

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        return self._requests.popleft()

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def preemption_victim(self, running: list[Request]) -> Request:
        return running[-1]  # the latest admitted: the one FCFS would serve last

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


class PriorityRequestQueue(RequestQueue):
    """Lower `priority` first, then earlier arrival, then the order of adding.

    A preempted request keeps its original key, so it returns to the place its
    priority and arrival give it (ahead of later equals), not behind them."""

    def __init__(self) -> None:
        self._requests: list[Request] = []  # sorted by _key
        self._count = itertools.count()
        # Weak keys: a finished request's tie-break leaves with it, unannounced.
        self._order: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()

    def _key(self, request: Request) -> tuple[int, float, int]:
        return (request.priority, request.arrival_time, self._order[request])

    def add(self, request: Request) -> None:
        self._order[request] = next(self._count)
        bisect.insort(self._requests, request, key=self._key)

    def add_front(self, request: Request) -> None:
        bisect.insort(self._requests, request, key=self._key)

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        return self._requests.pop(0)

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def preemption_victim(self, running: list[Request]) -> Request:
        return max(running, key=self._key)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


def make_request_queue(policy: str) -> RequestQueue:
    """The queue for a SchedulerConfig.policy: static batches are taken in FCFS order."""
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
