"""Futures and the request scheduler: strict ``seq_id`` order per model, one executor.

The SDK pipelines requests (a later one can arrive before an earlier result is fetched, and one
large ``forward_backward`` is split into chunks sent in parallel, the first one last) and retries
POSTs. So handlers only register work and return a future id at once; jobs are released to the
executor strictly in each model's ``seq_id`` order, and a retried ``seq_id`` maps to the future
it already has. No torch or DeepSpeed here: this is plain threading, testable on its own.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Future:
    """The result of one request, as ``retrieve_future`` reports it."""

    request_id: str
    status: str = "pending"  # pending | ok | error
    result: Any = None
    error: str = ""
    category: str = ""  # user | server


class FutureStoreFull(Exception):
    """No room for another future: the request is refused (HTTP 429), nothing is dropped."""


#: Defaults of ``--max-futures`` and ``--future-ttl-s``.
DEFAULT_MAX_FUTURES = 100_000
DEFAULT_FUTURE_TTL_S = 3600.0


class FutureStore:
    """Thread-safe futures with long-poll waiting, from threads (``wait``) or an event loop (``wait_async``: an
    HTTP long poll holds no thread while it waits).

    Bounded without losing work: a pending future is never dropped; a finished one is kept ``finished_ttl_s``
    after it finished (then ``retrieve_future`` answers 404). When ``max_futures`` futures are held, ``create``
    raises FutureStoreFull, which the API answers with 429, until finished ones expire.
    """

    def __init__(self, max_futures: int = DEFAULT_MAX_FUTURES, finished_ttl_s: float = DEFAULT_FUTURE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._futures: collections.OrderedDict[str, Future] = collections.OrderedDict()
        #: request_id -> when it finished, oldest first.
        self._finished: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.max_futures = max_futures
        self.finished_ttl_s = finished_ttl_s
        self._clock = clock
        #: Set by ``fail_all``: (error, category) every future gets, pending or new.
        self._failed_with: tuple[str, str] | None = None
        self._cond = threading.Condition()
        #: request_id -> the events of the coroutines waiting on it, each with its loop.
        self._async_waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._ids = itertools.count(1)

    def create(self, internal: bool = False) -> Future:
        """A new pending future; FutureStoreFull if the store is full (``internal``: the server's own bookkeeping
        jobs, e.g. unloading a closed session's models, which must not be refused, go in regardless)."""
        with self._cond:
            self._expire()
            if not internal and len(self._futures) >= self.max_futures:
                pending = len(self._futures) - len(self._finished)
                raise FutureStoreFull(
                    f"the server is full: it holds {pending} unfinished requests and {len(self._finished)} results "
                    f"kept for {self.finished_ttl_s:g} s after they finish, its limit of {self.max_futures} "
                    "(--max-futures); retry once requests finish")
            future = Future(f"req-{next(self._ids)}")
            self._futures[future.request_id] = future
            if self._failed_with is not None:  # born failed: see fail_all
                future.status, (future.error, future.category) = "error", self._failed_with
                self._finished[future.request_id] = self._clock()
            return future

    def check_room(self, count: int) -> None:
        """FutureStoreFull unless ``count`` more futures fit now."""
        with self._cond:
            self._expire()
            if len(self._futures) + count > self.max_futures:
                raise FutureStoreFull(f"the server is full: it holds {len(self._futures)} requests, its limit of "
                                      f"{self.max_futures} (--max-futures); retry once requests finish")

    def _expire(self) -> None:
        """Forget the results that finished more than ``finished_ttl_s`` ago (never a pending future)."""
        deadline = self._clock() - self.finished_ttl_s
        while self._finished:
            request_id, finished_at = next(iter(self._finished.items()))
            if finished_at > deadline:
                break
            del self._finished[request_id]
            self._futures.pop(request_id, None)

    def counts(self) -> tuple[int, int]:
        """(pending, finished and kept) futures."""
        with self._cond:
            return len(self._futures) - len(self._finished), len(self._finished)

    def resolve(self, request_id: str, result: Any) -> None:
        self._finish(request_id, status="ok", result=result)

    def fail(self, request_id: str, error: str, category: str) -> None:
        self._finish(request_id, status="error", error=error, category=category)

    def fail_all(self, error: str, category: str = "server") -> int:
        """Fail every pending future with ``error``, and every future created from now on (a server that lost a
        rank answers each request so while it drains, see ``faults``); how many were pending."""
        with self._cond:
            self._failed_with = (error, category)
            pending = [request_id for request_id, future in self._futures.items() if future.status == "pending"]
        for request_id in pending:
            self.fail(request_id, error, category)
        return len(pending)

    def _finish(self, request_id: str, **fields: Any) -> None:
        with self._cond:
            future = self._futures.get(request_id)
            if future is None or future.status != "pending":
                return
            for name, value in fields.items():
                setattr(future, name, value)
            self._finished[request_id] = self._clock()
            self._cond.notify_all()
            for loop, event in self._async_waiters.pop(request_id, ()):
                loop.call_soon_threadsafe(event.set)

    def wait(self, request_id: str, timeout: float) -> Future | None:
        """The future once finished, or still pending after ``timeout``; None if unknown."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                future = self._futures.get(request_id)
                remaining = deadline - time.monotonic()
                if future is None or future.status != "pending" or remaining <= 0:
                    return future
                self._cond.wait(remaining)

    async def wait_async(self, request_id: str, timeout: float) -> Future | None:
        """``wait`` for a coroutine: the event loop goes on serving other requests meanwhile."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            future = self._futures.get(request_id)
            if future is None or future.status != "pending" or timeout <= 0:
                return future
            self._async_waiters.setdefault(request_id, []).append((loop, event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._cond:
                waiters = self._async_waiters.get(request_id, [])
                if (loop, event) in waiters:
                    waiters.remove((loop, event))
                    if not waiters:
                        del self._async_waiters[request_id]
        with self._cond:
            return self._futures.get(request_id)


@dataclass
class Job:
    """One unit of work for the executor."""

    request_id: str
    kind: str
    model_id: str
    payload: Any = None


@dataclass
class _ModelSequence:
    next_seq: int
    waiting: dict[int, Job] = field(default_factory=dict)
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> request_id, for retries


class Scheduler:
    """Releases jobs to a single executor: FIFO across models, ``seq_id`` order within one."""

    def __init__(self, futures: FutureStore) -> None:
        self.futures = futures
        self._lock = threading.Condition()
        self._ready: collections.deque[Job] = collections.deque()
        self._models: dict[str, _ModelSequence] = {}
        self._stopped = False

    def open_model(self, model_id: str, first_seq: int = 1) -> bool:
        """Start ordering a model's requests; False if it is already open."""
        with self._lock:
            if model_id in self._models:
                return False
            self._models[model_id] = _ModelSequence(next_seq=first_seq)
            return True

    def close_model(self, model_id: str) -> None:
        with self._lock:
            self._models.pop(model_id, None)

    def has_model(self, model_id: str) -> bool:
        with self._lock:
            return model_id in self._models

    def submit(self, kind: str, model_id: str, payload: Any = None, internal: bool = False) -> str:
        """Queue a job that is not part of a model's sequence (model creation, unloading); FutureStoreFull (nothing
        queued) when the future store is full, unless ``internal``."""
        future = self.futures.create(internal)
        with self._lock:
            self._ready.append(Job(future.request_id, kind, model_id, payload))
            self._lock.notify_all()
        return future.request_id

    def submit_sequenced(self, model_id: str, seq_id: int, kind: str, payload: Any = None,
                         rejection: str | None = None) -> str:
        """Queue a job at ``seq_id`` in its model's order and return its future id.

        A ``seq_id`` seen before returns the first future (the SDK's retry). A ``rejection``
        (a user error found before execution) fails the future now but still fills the slot, so
        the requests after it run and the pending gradient accumulation is left untouched.
        Raises KeyError for a model that is not open and ValueError for a ``seq_id`` that
        already ran under another request.
        """
        with self._lock:
            sequence = self._models[model_id]
            if seq_id in sequence.seen:
                return sequence.seen[seq_id]
            if seq_id < sequence.next_seq:
                raise ValueError(f"seq_id {seq_id} of model {model_id} already ran (next is {sequence.next_seq})")
            future = self.futures.create()
            sequence.seen[seq_id] = future.request_id
            if rejection is not None:
                self.futures.fail(future.request_id, rejection, "user")
                job = Job(future.request_id, "noop", model_id)
            else:
                job = Job(future.request_id, kind, model_id, payload)
            sequence.waiting[seq_id] = job
            while sequence.next_seq in sequence.waiting:
                ready = sequence.waiting.pop(sequence.next_seq)
                sequence.next_seq += 1
                if ready.kind != "noop":
                    self._ready.append(ready)
            self._lock.notify_all()
            return future.request_id

    def next_job(self, timeout: float) -> Job | None:
        """The next job to execute, or None after ``timeout`` or once stopped."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._ready and not self._stopped:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._lock.wait(remaining)
            if self._stopped:
                return None
            return self._ready.popleft()

    def take_consecutive(self, kind: str, limit: int) -> list[Job]:
        """Up to ``limit`` more jobs of ``kind`` from the head of the queue, without waiting (the jobs that
        follow the one just taken, e.g. concurrent sampling requests to run as one batch); order is kept."""
        taken: list[Job] = []
        with self._lock:
            while self._ready and self._ready[0].kind == kind and len(taken) < limit:
                taken.append(self._ready.popleft())
        return taken

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped
