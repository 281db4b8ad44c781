"""HTTP responses as the request handlers build them (no server here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    #: Send this file's bytes as the body instead (streamed: checkpoint files can be large).
    file: Path | None = None


def json_response(value: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(value).encode())


def error_response(status: int, message: str) -> Response:
    return json_response({"error": message, "category": "user" if status < 500 else "server"}, status)
