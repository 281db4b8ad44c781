"""The replies kept for retried requests (an ``X-Idempotency-Key``, an ``asample``'s ``(sampling_session_id,
seq_id)``): a retried request gets its first reply again instead of running twice.

Kept per API key, each key's replies bounded on their own (least recently used out), so one tenant's flood of
requests never pushes out another tenant's replies (whose retry would then run again), and a key one tenant sends
is never answered with another tenant's reply.
"""

from __future__ import annotations

import collections
import threading

from .responses import Response

#: Replies kept per API key: the SDK retries a request within about a minute, so this covers about 160 requests a
#: second per key; a tenant that sends more pushes out only its own oldest replies.
MAX_REPLIES_PER_KEY = 10_000
#: ``asample`` replies kept per API key (an RL client sends many more samples than other requests).
MAX_SAMPLE_REPLIES_PER_KEY = 20_000
#: API keys with replies kept (least recently used out: a key that sent nothing for longest has no retries coming).
MAX_API_KEYS = 100


class IdempotencyReplies:

    def __init__(self, per_key: int = MAX_REPLIES_PER_KEY, api_keys: int = MAX_API_KEYS) -> None:
        self.per_key = per_key
        self.api_keys = api_keys
        self._lock = threading.Lock()
        self._replies: collections.OrderedDict[str, collections.OrderedDict[str, Response]] = (
            collections.OrderedDict())

    def get(self, api_key: str, key: str) -> Response | None:
        with self._lock:
            replies = self._replies.get(api_key)
            return None if replies is None else replies.get(key)

    def put(self, api_key: str, key: str, response: Response) -> Response:
        """Keep ``response`` as the reply to ``key`` unless one was kept meanwhile; the reply kept."""
        with self._lock:
            replies = self._replies.setdefault(api_key, collections.OrderedDict())
            self._replies.move_to_end(api_key)
            response = replies.setdefault(key, response)
            while len(replies) > self.per_key:
                replies.popitem(last=False)
            while len(self._replies) > self.api_keys:
                self._replies.popitem(last=False)
            return response
