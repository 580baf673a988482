"""Fair admission: one FIFO per client, admitted round-robin, bounded by running slots + queue places.

A client is a tenant (its key) or, without a key, its address (the proxy names it). The rules, from the
contract ("Admission"):

- A client alone may use the whole server: nothing is refused while a running slot or a queue place is
  free, whoever holds the others.
- When several clients wait, admission alternates between them: the client whose turn it is gives its
  oldest waiting job, then the next client's, so a client with 12 jobs waiting delays another client's
  single job by at most one admission.
- The queue full: a client already holding its share of the queue places (max_queue / clients waiting)
  while others wait is refused with 429 (`OverShare`, Retry-After); a client under its share takes the
  place of the newest job of the client most over its share (that job is refused with 429 instead);
  when nobody is over their share, the newcomer gets 503 (`QueueFull`).
- Cost-aware routing: a hit (its KV is stored here, where it is cheap) that finds the queue full takes
  the place of the newest waiting miss that the upstream could serve (`may_overflow`); that miss goes
  upstream. The queue never grows past its bound for it.
- A job cancelled while it waits leaves its queue at once (its place, its look-ahead window place and
  so its prefetch protection go with it).

Not thread-safe on its own: the scheduler guards it with its condition variable.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from engine_api.errors import OverShare, QueueFull

from .jobs import Job


@dataclass(frozen=True)
class Displaced:
    """A waiting job that gave its place to a newcomer: `over_share` (its client held more than its
    share: 429) or `overflow` (a miss the upstream serves instead, for a hit)."""

    job: Job
    reason: Literal["over_share", "overflow"]


class AdmissionQueue:
    def __init__(self, max_queue: int, max_running: int) -> None:
        self.max_queue = max_queue
        self.max_running = max_running
        # Per client, its waiting jobs (oldest first); the dict's order is the round-robin rotation:
        # the first client is the one whose turn comes next.
        self._queues: OrderedDict[str, deque[Job]] = OrderedDict()
        self._waiting = 0

    def __len__(self) -> int:
        return self._waiting

    def clients(self) -> int:
        return len(self._queues)

    def submit(self, job: Job, running: int, retry_after_s: float, *, hit: bool = False) -> Displaced | None:
        """Queue `job`, or raise QueueFull / OverShare. Returns the job this one displaced, now out of
        the queue, and why (the caller answers it), or None."""
        client = job.request.client
        if running + self._waiting < self.max_running + self.max_queue:
            self._append(job)
            return None
        if hit:
            miss = self._newest(lambda j: j.request.may_overflow)
            if miss is not None:
                self.remove(miss)
                self._append(job)
                return Displaced(miss, "overflow")
        others = [c for c in self._queues if c != client]
        if not others:
            raise QueueFull(
                f"the local runner is full ({self.max_running} running, {self.max_queue} waiting)"
            )
        share = max(1, self.max_queue // (len(others) + 1))
        mine = len(self._queues.get(client, ()))
        if mine >= share:
            raise OverShare(
                f"this client already has {mine} requests waiting, its share of the local queue while "
                f"{len(others)} other client(s) wait; retry after one has finished",
                retry_after_s,
            )
        victim = max(others, key=lambda c: len(self._queues[c]))
        if len(self._queues[victim]) <= share:
            raise QueueFull(
                f"the local runner is full ({self.max_running} running, {self.max_queue} waiting)"
            )
        displaced = self._queues[victim].pop()
        self._waiting -= 1
        self._append(job)
        return Displaced(displaced, "over_share")

    def _newest(self, pred: Callable[[Job], bool]) -> Job | None:
        found = [j for q in self._queues.values() for j in q if pred(j)]
        return max(found, key=lambda j: j.submitted_at, default=None)

    def _append(self, job: Job) -> None:
        client = job.request.client
        queue = self._queues.get(client)
        if queue is None:
            queue = self._queues[client] = deque()  # a new client joins the rotation at the end
        queue.append(job)
        self._waiting += 1

    def remove(self, job: Job) -> bool:
        """Take a waiting job out (its client went away). False if it is not waiting (any more)."""
        client = job.request.client
        queue = self._queues.get(client)
        if queue is None:
            return False
        try:
            queue.remove(job)
        except ValueError:
            return False
        self._waiting -= 1
        if not queue:
            del self._queues[client]
        return True

    def peek(self) -> Job | None:
        """The job whose turn comes next (not taken)."""
        for queue in self._queues.values():
            return queue[0]
        return None

    def pop(self) -> Job:
        """Take the next job: the oldest of the client whose turn it is, who then goes to the back of
        the rotation (or leaves it, with nothing left waiting)."""
        client, queue = next(iter(self._queues.items()))
        job = queue.popleft()
        self._waiting -= 1
        del self._queues[client]
        if queue:
            self._queues[client] = queue
        return job

    def in_order(self) -> Iterator[Job]:
        """Every waiting job in the order the rotation would admit them (for the look-ahead window and
        the store's schedule)."""
        queues = [list(q) for q in self._queues.values()]
        depth = max((len(q) for q in queues), default=0)
        for i in range(depth):
            for q in queues:
                if i < len(q):
                    yield q[i]

    def drain(self) -> list[Job]:
        jobs = [j for q in self._queues.values() for j in q]
        self._queues.clear()
        self._waiting = 0
        return jobs
