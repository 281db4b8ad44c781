"""Futures and the request scheduler: strict ``seq_id`` order per model, round-robin across sessions, one executor.

The SDK pipelines requests (a later one can arrive before an earlier result is fetched, and one
large ``forward_backward`` is split into chunks sent in parallel, the first one last) and retries
POSTs. So handlers only register work and return a future id at once; jobs are released strictly
in each model's ``seq_id`` order, and a retried ``seq_id`` maps to the future it already has.

Released jobs wait in one queue per session (a client's ``ServiceClient``), in order. The executor
takes the next job from the session with work that has used the ranks least (fair queuing by time,
round-robin among equals): a session that sends long requests (a batch of long completions) gets the
same share of the ranks' time as one that sends short ones (training steps), not the same number of
jobs, and a session that was idle does not bank credit (it starts level with the least-served busy
one). No torch or DeepSpeed here: this is plain threading, testable on its own.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .jobs import JobKind

log = logging.getLogger("tinker_server")


@dataclass
class Future:
    """The result of one request, as ``retrieve_future`` reports it."""

    request_id: str
    status: str = "pending"  # pending | ok | error
    result: Any = None
    error: str = ""
    category: str = ""  # user | server
    #: What the request is (the job kind), whose (session, model) and when it was accepted, started and finished
    #: (``time.monotonic``): for the metrics and the step log.
    kind: JobKind | None = None
    session: str = ""
    model_id: str = ""
    created: float = 0.0
    started: float | None = None
    finished: float | None = None


class FutureStoreFull(Exception):
    """No room for another future: the request is refused (HTTP 429), nothing is dropped."""


#: Defaults of ``--max-futures``, ``--future-ttl-s`` and ``--retrieved-grace-s``.
DEFAULT_MAX_FUTURES = 100_000
DEFAULT_FUTURE_TTL_S = 3600.0
DEFAULT_RETRIEVED_GRACE_S = 60.0
#: The share of ``--max-futures`` one session may hold by default (``--max-futures-per-session``).
DEFAULT_SESSION_SHARE = 4


def default_max_per_session(max_futures: int) -> int:
    """A quarter of the store: one session's flood leaves the other sessions three quarters of it."""
    return max(1, max_futures // DEFAULT_SESSION_SHARE)


class FutureStore:
    """Thread-safe futures with long-poll waiting, from threads (``wait``) or an event loop (``wait_async``: an
    HTTP long poll holds no thread while it waits).

    Bounded per session without losing work: a pending future is never dropped; a finished one is kept until
    ``retrieved_grace_s`` after the client last retrieved it (long enough for the SDK to retry a lost response) or
    ``finished_ttl_s`` after it finished, whichever comes first (then ``retrieve_future`` answers 404). A session
    holding ``max_per_session`` futures, or a store holding ``max_futures``, makes ``create`` raise
    FutureStoreFull, which the API answers with 429: one session's flood is refused while the others go on.
    """

    def __init__(self, max_futures: int = DEFAULT_MAX_FUTURES, finished_ttl_s: float = DEFAULT_FUTURE_TTL_S,
                 max_per_session: int | None = None, retrieved_grace_s: float = DEFAULT_RETRIEVED_GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._futures: collections.OrderedDict[str, Future] = collections.OrderedDict()
        #: request_id -> when it finished, oldest first.
        self._finished: collections.OrderedDict[str, float] = collections.OrderedDict()
        #: request_id -> when the client last retrieved it, oldest first (each is in ``_finished`` too).
        self._retrieved: collections.OrderedDict[str, float] = collections.OrderedDict()
        #: session -> the futures it holds (pending, or finished and kept).
        self._held: collections.Counter[str] = collections.Counter()
        self.max_futures = max_futures
        self.max_per_session = default_max_per_session(max_futures) if max_per_session is None else max_per_session
        self.finished_ttl_s = finished_ttl_s
        self.retrieved_grace_s = retrieved_grace_s
        self._clock = clock
        #: Set by ``fail_all``: (error, category) every future gets, pending or new.
        self._failed_with: tuple[str, str] | None = None
        self._cond = threading.Condition()
        #: request_id -> the events of the coroutines waiting on it, each with its loop.
        self._async_waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        #: Called with each future once it has finished (outside the store's lock): the server's metrics.
        self.on_finish: Callable[[Future], None] | None = None

    def create(self, session: str, internal: bool = False) -> Future:
        """A new pending future held by ``session`` (``""``: a request naming no session); FutureStoreFull if the
        session or the store is full. ``internal``: the server's own bookkeeping jobs (e.g. unloading a closed
        session's models) and a request that releases work already accepted (it fills a ``seq_id`` that later
        requests wait behind) go in regardless."""
        with self._cond:
            if not internal:
                self._check_room(1, session)
            # Unguessable: a request id is all retrieve_future asks for, so a counter would show one tenant's
            # results to another.
            future = Future(f"req-{secrets.token_hex(12)}", session=session, created=time.monotonic())
            self._futures[future.request_id] = future
            self._held[session] += 1
            failed_with = self._failed_with
        if failed_with is not None:  # born failed: see fail_all
            self.fail(future.request_id, *failed_with)
        return future

    @property
    def failed_with(self) -> str | None:
        """The error every request gets since ``fail_all`` (the server is draining after a fault), or None."""
        with self._cond:
            return None if self._failed_with is None else self._failed_with[0]

    def describe(self, request_id: str, kind: JobKind, model_id: str) -> None:
        """Say what a pending future is for (the scheduler does, as it queues its job)."""
        with self._cond:
            future = self._futures.get(request_id)
            if future is not None:
                future.kind, future.model_id = kind, model_id

    def mark_started(self, request_ids: list[str]) -> None:
        """The executor took these requests' jobs."""
        now = time.monotonic()
        with self._cond:
            for request_id in request_ids:
                future = self._futures.get(request_id)
                if future is not None and future.started is None:
                    future.started = now

    def check_room(self, count: int, session: str) -> None:
        """FutureStoreFull unless ``count`` more futures of ``session`` fit now."""
        with self._cond:
            self._check_room(count, session)

    def _check_room(self, count: int, session: str) -> None:
        self._expire()
        if self._held[session] + count > self.max_per_session:
            raise FutureStoreFull(
                f"session {session or '(none)'} holds {self._held[session]} requests, the limit per session is "
                f"{self.max_per_session} (--max-futures-per-session): retrieve their results, or retry once they "
                f"finish (a result is freed {self.retrieved_grace_s:g} s after it is retrieved)")
        if len(self._futures) + count > self.max_futures:
            raise FutureStoreFull(
                f"the server is full: it holds {len(self._futures) - len(self._finished)} unfinished requests and "
                f"{len(self._finished)} results, its limit of {self.max_futures} (--max-futures); retry once "
                "requests finish")

    def retrieved(self, request_id: str) -> None:
        """The client has a finished future's result: free it a grace after its last retrieval (time for a retry of
        a lost or slow response)."""
        with self._cond:
            if request_id in self._finished:
                self._retrieved[request_id] = self._clock()
                self._retrieved.move_to_end(request_id)

    def _forget(self, request_id: str) -> None:
        self._finished.pop(request_id, None)
        self._retrieved.pop(request_id, None)
        future = self._futures.pop(request_id, None)
        if future is not None:
            self._held[future.session] -= 1
            if not self._held[future.session]:
                del self._held[future.session]

    def _expire(self) -> None:
        """Forget the results retrieved more than ``retrieved_grace_s`` ago and those that finished more than
        ``finished_ttl_s`` ago (never a pending future)."""
        now = self._clock()
        for kept, lifetime in ((self._retrieved, self.retrieved_grace_s), (self._finished, self.finished_ttl_s)):
            while kept:
                request_id, since = next(iter(kept.items()))
                if since > now - lifetime:
                    break
                self._forget(request_id)

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
            future.finished = time.monotonic()
            self._finished[request_id] = self._clock()
            self._cond.notify_all()
            for loop, event in self._async_waiters.pop(request_id, ()):
                loop.call_soon_threadsafe(event.set)
        if self.on_finish is not None:
            try:
                self.on_finish(future)
            except Exception:  # metrics must never fail a request
                log.exception("recording the metrics of %s failed", request_id)

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
        except TimeoutError:
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
    kind: JobKind
    model_id: str
    payload: Any = None
    #: The session whose turn this job takes (``Scheduler``'s round-robin).
    session: str = ""


@dataclass
class _ModelSequence:
    next_seq: int
    session: str = ""
    #: seq_id -> its job, held back behind an earlier seq_id (None: a request rejected before it ran, which only
    #: fills its slot).
    waiting: dict[int, Job | None] = field(default_factory=dict)
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> request_id, for retries


@dataclass(frozen=True)
class QueuePosition:
    """Where a pending request is: ``held`` (behind an earlier ``seq_id`` of its model that has not arrived or
    not run), or ``queued`` with ``own`` earlier jobs of its session and about ``others`` jobs of ``sessions``
    other sessions to run before it."""

    state: str
    own: int = 0
    others: int = 0
    sessions: int = 0


class Scheduler:
    """Releases jobs to a single executor: ``seq_id`` order within a model, FIFO within a session, fair (by the
    ranks' time used) across sessions."""

    def __init__(self, futures: FutureStore, clock: Callable[[], float] = time.monotonic) -> None:
        self.futures = futures
        self._clock = clock  # what the ranks' time is measured with
        self._lock = threading.Condition()
        #: session -> its released jobs in order; the dict's order is the round-robin's (the next turn first).
        self._queues: collections.OrderedDict[str, collections.deque[Job]] = collections.OrderedDict()
        self._models: dict[str, _ModelSequence] = {}
        self._last_session: str | None = None
        #: session -> seconds of the ranks' time its jobs have used (while it had work waiting, or debt).
        self._used: dict[str, float] = {}
        #: The used time of the session last served: where a session that starts waiting starts.
        self._virtual = 0.0
        #: The jobs the executor took last and when: charged to their sessions when it comes back for more.
        self._running: list[Job] = []
        self._running_since = 0.0
        self._stopped = False

    def open_model(self, model_id: str, first_seq: int = 1, session: str | None = None) -> bool:
        """Start ordering a model's requests (in ``session``'s turns; default: a session of its own); False if it is
        already open."""
        with self._lock:
            if model_id in self._models:
                return False
            self._models[model_id] = _ModelSequence(next_seq=first_seq,
                                                    session=model_id if session is None else session)
            return True

    def close_model(self, model_id: str, message: str) -> None:
        """Stop ordering a model's requests: those released still run; those held back behind a ``seq_id`` that
        never came can never run, so they fail with ``message`` (a user error) instead of staying pending."""
        with self._lock:
            sequence = self._models.pop(model_id, None)
        for job in sequence.waiting.values() if sequence is not None else ():
            if job is not None:
                self.futures.fail(job.request_id, message, "user")

    def has_model(self, model_id: str) -> bool:
        with self._lock:
            return model_id in self._models

    def _session_of(self, model_id: str, session: str | None) -> str:
        if session is not None:
            return session
        sequence = self._models.get(model_id)
        return sequence.session if sequence is not None else model_id

    def _release(self, job: Job) -> None:
        """Put a job at the end of its session's queue (a session new to the round-robin takes the last turn)."""
        queue = self._queues.get(job.session)
        if queue is None:
            queue = self._queues[job.session] = collections.deque()
            self._used[job.session] = max(self._used.get(job.session, 0.0), self._virtual)
        queue.append(job)

    def submit(self, kind: JobKind, model_id: str, payload: Any = None, internal: bool = False,
               session: str | None = None) -> str:
        """Queue a job that is not part of a model's sequence (model creation, unloading, sampling) in ``session``'s
        turns (default: its model's session); FutureStoreFull (nothing queued) when the session or the store is full,
        unless ``internal``."""
        with self._lock:
            session = self._session_of(model_id, session)
        future = self.futures.create(session, internal)
        with self._lock:
            self.futures.describe(future.request_id, kind, model_id)
            self._release(Job(future.request_id, kind, model_id, payload, session))
            self._lock.notify_all()
        return future.request_id

    def submit_sequenced(self, model_id: str, seq_id: int, kind: JobKind, payload: Any = None,
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
            # The seq_id that held-back requests wait for releases work already accepted: it is never refused (a
            # later one is, until then: otherwise a client could queue without bound behind one far-off seq_id)
            releases_held_work = seq_id == sequence.next_seq and bool(sequence.waiting)
            future = self.futures.create(sequence.session, internal=releases_held_work)
            self.futures.describe(future.request_id, kind, model_id)
            sequence.seen[seq_id] = future.request_id
            if rejection is not None:
                self.futures.fail(future.request_id, rejection, "user")
                sequence.waiting[seq_id] = None
            else:
                sequence.waiting[seq_id] = Job(future.request_id, kind, model_id, payload, sequence.session)
            while sequence.next_seq in sequence.waiting:
                ready = sequence.waiting.pop(sequence.next_seq)
                sequence.next_seq += 1
                if ready is not None:
                    self._release(ready)
            self._lock.notify_all()
            return future.request_id

    def _charge(self) -> None:
        """Charge the time since the executor took its last jobs (it has finished them) to their sessions."""
        if not self._running:
            return
        share = (self._clock() - self._running_since) / len(self._running)
        for job in self._running:
            if job.session in self._used or job.session in self._queues:
                self._used[job.session] = self._used.get(job.session, self._virtual) + share
        self._running = []
        for session in [s for s, used in self._used.items() if s not in self._queues and used <= self._virtual]:
            del self._used[session]  # idle and without debt: it would start at the virtual time anyway

    def _take(self, jobs: list[Job]) -> None:
        self._running.extend(jobs)
        if len(self._running) == len(jobs):
            self._running_since = self._clock()

    def next_job(self, timeout: float) -> Job | None:
        """The next job to execute: the first of the waiting session that has used the ranks least (the earliest
        in round-robin order among equals; a session served goes to the end of that order); None after
        ``timeout`` or once stopped."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._charge()
            while not self._queues and not self._stopped:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._lock.wait(remaining)
            if self._stopped:
                return None
            session = min(self._queues, key=lambda s: self._used.get(s, self._virtual))  # first of the least
            queue = self._queues[session]
            self._virtual = self._used.get(session, self._virtual)
            job = queue.popleft()
            if queue:
                self._queues.move_to_end(session)
            else:
                del self._queues[session]
            self._last_session = session
            self._take([job])
        self.futures.mark_started([job.request_id])
        return job

    def take_consecutive(self, kind: JobKind, limit: int) -> list[Job]:
        """Up to ``limit`` more jobs of ``kind`` to run with the one just taken (e.g. concurrent sampling requests as
        one batch), without waiting: first those that follow it in its session, then the first ones of the other
        sessions in round-robin order (those sessions have had their turn then). Each session's order is kept."""
        taken: list[Job] = []
        with self._lock:
            first = [self._last_session] if self._last_session in self._queues else []
            for session in first + [s for s in list(self._queues) if s != self._last_session]:
                queue = self._queues[session]
                served = False
                while queue and queue[0].kind == kind and len(taken) < limit:
                    taken.append(queue.popleft())
                    served = True
                if not queue:
                    del self._queues[session]
                elif served and session != self._last_session:
                    self._queues.move_to_end(session)
                if len(taken) >= limit:
                    break
            self._take(taken)
        self.futures.mark_started([job.request_id for job in taken])
        return taken

    def drop_session(self, session: str, message: str) -> list[str]:
        """Close every model of ``session`` and fail every job of it not yet taken by the executor (released or
        held back behind a ``seq_id``) with ``message`` as a user error; the model ids closed. A job already
        running finishes."""
        with self._lock:
            jobs: list[Job | None] = list(self._queues.pop(session, ()))
            self._used.pop(session, None)
            closed = [model_id for model_id, sequence in self._models.items() if sequence.session == session]
            for model_id in closed:
                jobs.extend(self._models.pop(model_id).waiting.values())
        for job in jobs:
            if job is not None:
                self.futures.fail(job.request_id, message, "user")
        return closed

    def depths(self) -> dict[str, int]:
        """Jobs waiting per session: released and not yet taken, plus those held back behind a ``seq_id``."""
        with self._lock:
            depths = {session: len(queue) for session, queue in self._queues.items()}
            for sequence in self._models.values():
                held = sum(1 for job in sequence.waiting.values() if job is not None)
                if held:
                    depths[sequence.session] = depths.get(sequence.session, 0) + held
            return depths

    def position(self, request_id: str) -> QueuePosition | None:
        """Where a request's job waits; None when it is not waiting (running, finished or unknown)."""
        with self._lock:
            used = [self._used.get(s, self._virtual) for s in self._queues]
            order = list(self._queues.items())
            for turn, (session, queue) in enumerate(order):
                for index, job in enumerate(queue):
                    if job.request_id != request_id:
                        continue
                    # About: sessions that have used less (or as much, and are ahead in the round-robin) run
                    # index + 1 jobs before it, the others index jobs (fair queuing by time evens the rest out).
                    ahead = [used[t] < used[turn] or (used[t] == used[turn] and t < turn) for t in range(len(order))]
                    others = [min(len(q), index + (1 if ahead[t] else 0)) for t, (_, q) in enumerate(order)
                              if t != turn]
                    return QueuePosition("queued", index, sum(others), sum(1 for n in others if n))
            for sequence in self._models.values():
                if any(job is not None and job.request_id == request_id for job in sequence.waiting.values()):
                    return QueuePosition("held")
        return None

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped
