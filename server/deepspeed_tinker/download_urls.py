"""Signed download URLs for the files of an external-weights checkpoint.

The SDK's ``get_external_weights_urls`` returns one URL per file, and ``tinker checkpoint download``
and tinker-cookbook's ``weights.download`` fetch them with plain ``urllib`` (no API key), as one
fetches a cloud bucket's signed URLs. So a URL carries its own authorisation: the run, checkpoint,
file and expiry, signed with HMAC-SHA256 under a key this server process draws at start-up (a
restart invalidates old URLs; the SDK signs new ones when it needs them).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

#: Where the signed URLs live, outside ``/api/v1/`` (which wants an API key).
PREFIX = "/files/"
#: How long a signed URL stays valid (the SDK signs new ones 5 minutes before this).
URL_LIFETIME_S = 3600


@dataclass(frozen=True)
class SignedFile:
    run_id: str
    checkpoint_id: str
    file: str  # relative to the checkpoint directory, '/'-separated
    expires: float


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class UrlSigner:
    def __init__(self, key: bytes | None = None, clock=time.time) -> None:
        self._key = key or secrets.token_bytes(32)
        self._clock = clock

    def sign(self, base_url: str, run_id: str, checkpoint_id: str, file: str, expires: float) -> str:
        payload = _b64(json.dumps([run_id, checkpoint_id, file, expires]).encode())
        signature = _b64(hmac.new(self._key, payload.encode(), hashlib.sha256).digest())
        return f"{base_url}{PREFIX}{payload}.{signature}"

    def verify(self, token: str) -> SignedFile | None:
        """The file a URL's token names, or None if it is forged, malformed or expired."""
        payload, _, signature = token.partition(".")
        expected = _b64(hmac.new(self._key, payload.encode(), hashlib.sha256).digest())
        if not signature or not hmac.compare_digest(signature, expected):
            return None
        try:
            run_id, checkpoint_id, file, expires = json.loads(_unb64(payload))
        except (ValueError, TypeError):
            return None
        if self._clock() >= float(expires):
            return None
        return SignedFile(str(run_id), str(checkpoint_id), str(file), float(expires))
