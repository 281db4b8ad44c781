"""The server's HTTP app in-process, through Starlette's TestClient: what a client sees (routing, key check, body
limit, status codes), with no ranks and no sockets."""

from __future__ import annotations

from dataclasses import dataclass

from deepspeed_tinker.api import TinkerApi
from deepspeed_tinker.http_app import HttpSettings, build_app

_clients: dict[int, tuple[TinkerApi, object]] = {}


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str


def client(api: TinkerApi, settings: HttpSettings | None = None):
    """A TestClient of ``build_app(api, settings)`` (one per api object, made on first use)."""
    from starlette.testclient import TestClient

    if settings is not None or id(api) not in _clients or _clients[id(api)][0] is not api:
        app = build_app(api, settings or HttpSettings())
        _clients[id(api)] = (api, TestClient(app, raise_server_exceptions=False))
    return _clients[id(api)][1]


def handle(api: TinkerApi, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> Reply:
    """One request to the app; ``headers`` as sent (a Host header too)."""
    response = client(api).request(method, path, headers=headers, content=body or None)
    return Reply(response.status_code, response.content, response.headers.get("content-type", "").split(";")[0])
