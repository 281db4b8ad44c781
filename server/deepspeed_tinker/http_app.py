"""The HTTP side of rank 0: FastAPI routes over ``TinkerApi`` / ``RunsApi``, served by uvicorn from a thread.

Why each piece:

- Routing is FastAPI's, one declared route per endpoint the tinker SDK calls; the protocol logic stays in
  ``api`` / ``runs_api`` (plain methods, no HTTP server), so the in-process tests drive the same app through
  Starlette's ``TestClient``.
- Request bodies are validated with the SDK's own pydantic types where the protocol answers a bad body with a
  400 (``retrieve_future``, ``get_info``, ``session_heartbeat``, ``create_sampling_session``). The requests that
  take a model's ``seq_id`` keep their own checks: a bad field there must fail that request's future and still
  fill its slot in the model's order, or every later request of the model would wait forever.
- ``retrieve_future`` awaits the future on the event loop (``FutureStore.wait_async``): a long poll holds no thread.
  The other handlers are short and run on Starlette's thread pool.
- ``BodyLimit`` refuses a body over ``max_body_bytes`` with 413 before reading more than that limit into memory.
- uvicorn writes an access log line per request (``--no-access-log`` turns it off).
- ``GET /metrics`` (``metrics.py``), outside ``/api/v1/``: with API keys it takes one of them, in ``X-API-Key`` or
  as ``Authorization: Bearer`` (what Prometheus sends), because its labels name every open session, and a session
  id is what addresses a user's models; without keys it is open, like the server, on loopback only.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from fastapi.responses import Response as HttpResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from tinker import types

from .api import API, PostHandler, TinkerApi
from .download_urls import PREFIX as DOWNLOADS
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .responses import Response, error_response, json_response

log = logging.getLogger("tinker_server")

#: The default request body limit: far above the largest request the SDK sends with the server's default chunk size.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
#: How long an idle kept-alive connection stays open (the SDK pools connections between calls).
DEFAULT_KEEP_ALIVE_S = 75.0


@dataclass(frozen=True)
class HttpSettings:
    #: Bodies larger than this get 413 (``--max-body-bytes``).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: The API keys accepted in ``X-API-Key``; empty: any key with the SDK's ``tml-`` prefix (loopback only).
    api_keys: frozenset[str] = frozenset()
    #: One log line per request (uvicorn's access log).
    access_log: bool = True
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S


def to_http(response: Response) -> HttpResponse:
    """The protocol layer's response as Starlette's; an error says the SDK should not retry it."""
    headers = {"x-should-retry": "false"} if response.status >= 400 else None
    if response.status == 429:  # the server is full: the SDK retries (with backoff), then raises this message
        headers = {"retry-after": "1"}
    if response.file is not None:
        if not response.file.is_file():  # deleted since the handler looked
            return to_http(error_response(404, "the file is gone"))
        return FileResponse(response.file, media_type=response.content_type)
    return HttpResponse(response.body, response.status, headers=headers, media_type=response.content_type)


class BodyLimit:
    """ASGI middleware: a request whose body is over ``max_bytes`` gets 413 naming the limit, found from its
    ``Content-Length`` before any of it is read, or (chunked) as soon as the bytes read pass the limit. At most
    ``max_bytes`` are ever held; the connection is closed after the 413, the server goes on."""

    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Callable) -> None:
        response = error_response(413, f"the request body is over this server's limit of {self.max_bytes} bytes "
                                  "(--max-body-bytes)")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"x-should-retry", b"false"),
                                (b"content-length", str(len(response.body)).encode())]})
        await send({"type": "http.response.body", "body": response.body})


def _validation_message(errors: Any) -> str:
    parts = []
    for error in errors:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def build_app(api: TinkerApi, settings: HttpSettings = HttpSettings()) -> FastAPI:
    """The ASGI application: every route of the protocol, the key check, the body limit."""
    app = FastAPI(title="deepspeed-tinker", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> HttpResponse:
        if exc.status_code == 404:
            return to_http(error_response(404, f"no such endpoint {request.url.path}"))
        if exc.status_code == 405:
            return to_http(error_response(405, f"{request.method} is not supported on {request.url.path}"))
        return to_http(error_response(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> HttpResponse:
        return to_http(error_response(400, _validation_message(exc.errors())))

    async def check_key(request: Request) -> None:  # async: a sync dependency would take a pool thread
        key = request.headers.get("x-api-key", "")
        if settings.api_keys:
            if not any(hmac.compare_digest(key.encode(), accepted.encode()) for accepted in settings.api_keys):
                raise HTTPException(401, "unknown API key (X-API-Key)")
        elif not key.startswith("tml-"):
            raise HTTPException(401, "an API key starting with 'tml-' is required (X-API-Key)")

    v1 = APIRouter(prefix=API.rstrip("/"), dependencies=[Depends(check_key)])

    @v1.get("/healthz")
    async def healthz() -> HttpResponse:
        # A server draining after a fault (see faults) is not healthy: a load balancer or supervisor sees 503.
        fault = api.futures.failed_with
        if fault is None and api.vllm is not None and api.vllm.process is not None:
            fault = api.vllm.process.exited()  # samples fail with it; training goes on
        if fault is not None:
            return to_http(json_response({"status": "failed", "error": fault}, status=503))
        return to_http(json_response({"status": "ok"}))

    @v1.get("/get_server_capabilities")
    async def capabilities() -> HttpResponse:
        return to_http(api.capabilities())

    @v1.get("/samplers/{sampler_id}")
    def sampler(sampler_id: str) -> HttpResponse:
        return to_http(api.sampler(sampler_id))

    @v1.post("/retrieve_future")
    async def retrieve_future(request: Request) -> HttpResponse:
        body = _parse(types.FutureRetrieveRequest, await request.body())
        if isinstance(body, HttpResponse):
            return body
        return to_http(await api.retrieve_future(body.request_id, request.headers.get("accept", "")))

    async def validated_post(handler: PostHandler, model: type, request: Request) -> HttpResponse:
        raw = await request.body()
        invalid = _parse(model, raw)
        if isinstance(invalid, HttpResponse):
            return invalid
        return await _post(handler, request, raw)

    async def _post(handler: PostHandler, request: Request, raw: bytes | None = None) -> HttpResponse:
        body = await request.body() if raw is None else raw
        headers = {k.lower(): v for k, v in request.headers.items()}
        return to_http(await run_in_threadpool(api.post, handler, headers, body))

    typed = {"get_info": types.GetInfoRequest, "session_heartbeat": types.SessionHeartbeatRequest,
             "create_sampling_session": types.CreateSamplingSessionRequest}
    for route, handler in api.post_routes().items():  # routed once: each route is bound to its handler
        if route in typed:
            endpoint = _bind(validated_post, handler, typed[route])
        else:
            endpoint = _bind(_post, handler)
        v1.add_api_route(f"/{route}", endpoint, methods=["POST"], name=route)

    @v1.post("/sessions/{session_id}/finish")
    def finish_session(session_id: str) -> HttpResponse:
        return to_http(api.finish_session(session_id))

    runs = api.runs

    @v1.get("/training_runs")
    def training_runs(request: Request) -> HttpResponse:
        return to_http(runs.list_runs(dict(request.query_params)))

    @v1.get("/checkpoints")
    def checkpoints(request: Request) -> HttpResponse:
        return to_http(runs.list_checkpoints(dict(request.query_params)))

    @v1.post("/weights_info")
    async def weights_info(request: Request) -> HttpResponse:
        body = await request.body()
        return to_http(await run_in_threadpool(runs.weights_info, body))

    @v1.get("/training_runs/{run_id}")
    def training_run(run_id: str) -> HttpResponse:
        return to_http(runs.run(run_id))

    @v1.get("/training_runs/{run_id}/checkpoints")
    def run_checkpoints(run_id: str) -> HttpResponse:
        return to_http(runs.run(run_id, checkpoints=True))

    checkpoint = "/training_runs/{run_id}/checkpoints/{kind}/{name}"

    @v1.delete(checkpoint)
    def delete_checkpoint(run_id: str, kind: str, name: str) -> HttpResponse:
        return to_http(runs.delete(run_id, kind, name))

    @v1.put(checkpoint + "/ttl")
    async def set_ttl(run_id: str, kind: str, name: str, request: Request) -> HttpResponse:
        body = await request.body()
        return to_http(await run_in_threadpool(runs.set_ttl, run_id, kind, name, body))

    @v1.get(checkpoint + "/external_weights_urls")
    def external_weights_urls(run_id: str, kind: str, name: str, request: Request) -> HttpResponse:
        return to_http(runs.urls(run_id, kind, name, request.headers.get("host", "127.0.0.1")))

    app.include_router(v1)

    @app.get("/metrics")
    def metrics(request: Request) -> HttpResponse:  # sync: reading the ranks' memory is a store round trip
        if settings.api_keys:
            key = request.headers.get("x-api-key", "")
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() == "bearer" and not key:
                key = token.strip()
            if not any(hmac.compare_digest(key.encode(), accepted.encode()) for accepted in settings.api_keys):
                raise HTTPException(401, "an API key is required for /metrics (X-API-Key, or Authorization: Bearer)")
        return HttpResponse(api.metrics.render(), 200, media_type=METRICS_CONTENT_TYPE)

    @app.get(DOWNLOADS + "{token}")  # signed URLs carry their own authorisation: no API key here
    def download(token: str) -> HttpResponse:
        return to_http(runs.serve_file(token))

    return BodyLimit(app, settings.max_body_bytes)  # type: ignore[return-value]


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    """A JSON body as the SDK's pydantic type, or the 400 naming what is wrong (whatever the Content-Type: the
    server never required one)."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        return to_http(error_response(400, _validation_message(e.errors())))


Endpoint = Callable[[Request], Awaitable[HttpResponse]]


def _bind(function: Callable[..., Awaitable[HttpResponse]], *bound: Any) -> Endpoint:
    """A route endpoint taking only the request (FastAPI reads the endpoint's signature)."""

    async def endpoint(request: Request) -> HttpResponse:
        return await function(*bound, request)

    return endpoint


class HttpServer:
    """uvicorn serving the app from a daemon thread of rank 0 (the main thread drives the ranks)."""

    def __init__(self, app: Any, host: str, port: int, settings: HttpSettings = HttpSettings()) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without it
        # a response written in two parts (headers, body) waits ~40 ms on the client's delayed ACK (Nagle).
        self.socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        # uvloop and httptools (C) rather than asyncio's loop and h11 (pure Python): this thread shares the GIL with
        # the rank's work, and h11's parsing was the largest part of the HTTP thread's share of it.
        config = uvicorn.Config(app, access_log=settings.access_log, timeout_keep_alive=int(settings.keep_alive_s),
                                log_level="info", lifespan="off", loop="uvloop", http="httptools",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="tinker-http", daemon=True)

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1]

    def start(self, timeout_s: float = 30.0) -> HttpServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
