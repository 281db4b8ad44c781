"""Who is connected: client sessions, their training models and sampling sessions, and why a closed one closed.

The protocol layer's registry on rank 0 (the weights live on the ranks). Handlers run on many threads: one lock
guards every map, and a model is registered in the same critical section that queues its creation, so a retried
``create_model`` never creates twice.
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .errors import UserError
from .model import BASE_MODELS, BaseModelSpec, LoraSpec
from .sampling import SnapshotRef

#: Closed sessions whose reason is kept (a later request of one is told why it closed).
MAX_CLOSED_REMEMBERED = 100_000


@dataclass(frozen=True)
class ModelRecord:
    """What the protocol layer knows about a training model (the weights live on the ranks)."""

    model_id: str
    session_id: str
    base_model: str
    lora: LoraSpec | None
    #: What the client attached at creation; listed with the training run.
    user_metadata: dict[str, Any] | None = None

    @property
    def spec(self) -> BaseModelSpec:
        return BASE_MODELS[self.base_model]


@dataclass(frozen=True)
class SamplingSession:
    sampling_session_id: str
    base_model: str
    model_path: str | None
    snapshot: SnapshotRef


def session_of(model_or_sampler_id: str) -> str:
    """The session a model id (``<session>:train:<n>``) or sampling session id (``<session>:sample:<n>``) is of;
    ``""`` for any other id."""
    for marker in (":train:", ":sample:"):
        if marker in model_or_sampler_id:
            return model_or_sampler_id.rsplit(marker, 1)[0]
    return ""


class SessionRegistry:
    """Open sessions with their last sign of life, their models and sampling sessions; closed ones' reasons."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models_of: dict[str, set[str]] = {}  # open session_id -> its model ids
        self._seen: dict[str, float] = {}  # open session_id -> its last heartbeat or request (time.monotonic)
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()  # session_id -> why closed
        self._models: dict[str, ModelRecord] = {}
        self._creates: dict[str, str] = {}  # model_id -> the future its creation reported
        self._samplers: dict[str, SamplingSession] = {}
        self._touched: dict[str, float] = {}  # model_id -> when its run's last_request_time was last written

    def open(self) -> str:
        """A new session's id: unguessable, as its models' and sampling sessions' ids (which start with it) are all
        a request on them names."""
        session_id = f"s{secrets.token_hex(8)}"
        with self._lock:
            self._models_of[session_id] = set()
            self._seen[session_id] = time.monotonic()
        return session_id

    def count(self) -> int:
        with self._lock:
            return len(self._models_of)

    def touch(self, session_id: str, now: float | None = None) -> bool:
        """Note that a session is in use (a heartbeat or any request of it); False if it is not open."""
        with self._lock:
            if session_id not in self._models_of:
                return False
            self._seen[session_id] = time.monotonic() if now is None else now
            return True

    def closed_reason(self, session_id: str) -> str | None:
        with self._lock:
            return self._closed.get(session_id)

    def gone(self, session_id: str) -> str:
        """Why a session is not open: closed (and why), or unknown to this server."""
        reason = self.closed_reason(session_id)
        if reason is not None:
            return f"session {session_id} was closed: {reason}; create a new ServiceClient"
        return (f"unknown session {session_id!r} (closed, or from before a restart of this server); create a new "
                "ServiceClient")

    def check(self, session_id: str) -> None:
        """UserError unless ``session_id`` is open; marks it as in use."""
        if not self.touch(session_id):
            raise UserError(self.gone(session_id))

    def idle(self, now: float, timeout: float) -> list[tuple[str, float]]:
        """The open sessions without a sign of life for over ``timeout`` seconds, with how long."""
        with self._lock:
            return [(session_id, now - seen) for session_id, seen in self._seen.items() if now - seen > timeout]

    def close(self, session_id: str, reason: str, samplers: bool = True) -> set[str]:
        """Forget a session and its models (and, with ``samplers``, its sampling sessions); its model ids."""
        with self._lock:
            model_ids = self._models_of.pop(session_id, set())
            self._seen.pop(session_id, None)
            self._closed[session_id] = reason
            while len(self._closed) > MAX_CLOSED_REMEMBERED:
                self._closed.popitem(last=False)
            for model_id in model_ids:
                self._models.pop(model_id, None)
                self._creates.pop(model_id, None)
                self._touched.pop(model_id, None)
            if samplers:
                prefix = f"{session_id}:sample:"
                for sampler_id in [s for s in self._samplers if s.startswith(prefix)]:
                    del self._samplers[sampler_id]
        return model_ids

    def add_model(self, record: ModelRecord, create: Callable[[], str]) -> str:
        """Register a model and queue its creation (``create``, called under the lock, returns the future the
        client waits on); a retried create of the same model id gets the first future back."""
        with self._lock:
            request_id = self._creates.get(record.model_id)
            if request_id is not None:
                return request_id
            if record.session_id not in self._models_of:  # closed since the handler checked it
                raise UserError(f"session {record.session_id} was closed: "
                                f"{self._closed.get(record.session_id, 'unknown')}")
            request_id = create()
            self._models[record.model_id] = record
            self._models_of[record.session_id].add(record.model_id)
            self._creates[record.model_id] = request_id
            return request_id

    def model(self, model_id: str) -> ModelRecord:
        """A training model; UserError saying why when it is unknown or its session was closed."""
        with self._lock:
            record = self._models.get(model_id)
        if record is None:
            raise self._missing("model", model_id, "model id")
        return record

    def add_sampler(self, session: SamplingSession) -> None:
        with self._lock:
            self._samplers.setdefault(session.sampling_session_id, session)

    def find_sampler(self, sampler_id: str) -> SamplingSession | None:
        with self._lock:
            return self._samplers.get(sampler_id)

    def sampler(self, sampler_id: str) -> SamplingSession:
        """A sampling session; UserError saying why when it is unknown or its session was closed."""
        sampler = self.find_sampler(sampler_id)
        if sampler is None:
            raise self._missing("sampling session", sampler_id, "sampling session")
        return sampler

    def _missing(self, kind: str, object_id: str, unknown: str) -> UserError:
        """Why a model or sampling session is not here: its session was closed (and why), or it is an unknown
        ``unknown``."""
        closed = self.closed_reason(session_of(object_id))
        if closed is not None:
            return UserError(f"{kind} {object_id} is gone: its session {session_of(object_id)} was closed: {closed}")
        return UserError(f"unknown {unknown} {object_id!r}")

    def run_touch_due(self, model_id: str, every_s: float = 1.0) -> bool:
        """Whether a model's training run should have its last request time written now (at most once per
        ``every_s``: a step can be many requests)."""
        now = time.monotonic()
        with self._lock:
            if now - self._touched.get(model_id, -1.0) < every_s:
                return False
            self._touched[model_id] = now
            return True
