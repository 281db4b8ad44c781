"""The RestClient's endpoints: training runs, checkpoints (list, get, delete, TTL) and weight downloads.

Routes and shapes are those the tinker 0.38.0 SDK calls (``RestClient``, ``tinker checkpoint`` /
``tinker run``, tinker-cookbook's ``weights.download``): ``GET training_runs[/{id}[/checkpoints]]``,
``GET checkpoints``, ``DELETE training_runs/{id}/checkpoints/{segment}/{name}``, ``PUT .../ttl``,
``GET .../external_weights_urls`` (signed URLs, one per file), ``POST weights_info``; the signed
URLs themselves are served under ``/files/`` without an API key. The routing is ``http_app``'s (FastAPI).
"""

from __future__ import annotations

import functools
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Callable

from .checkpoint_store import SEGMENTS, CheckpointStore, TinkerPath
from .download_urls import URL_LIFETIME_S, UrlSigner
from .errors import UserError
from .responses import Response, error_response, json_response

#: The longest TTL Tinker accepts (10 years). The shortest is not enforced: an hour is Tinker's
#: minimum, but a local server has no reason to keep an unwanted export that long.
MAX_TTL_S = 10 * 365 * 24 * 3600
#: The checkpoint types of the ``training_runs/{run}/checkpoints/{type}/{name}`` routes.
CHECKPOINT_KINDS = tuple(SEGMENTS.values())


def parse_ttl(value: Any) -> int | None:
    """A request's ``ttl_seconds``: None (never expires) or whole seconds in [1, 10 years]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TTL_S:
        raise UserError(f"ttl_seconds must be a whole number of seconds from 1 to {MAX_TTL_S}, or null; "
                        f"got {value!r}")
    return value


def _page(query: dict[str, str], default_limit: int) -> tuple[int, int]:
    try:
        limit, offset = int(query.get("limit", default_limit)), int(query.get("offset", 0))
    except ValueError:
        raise UserError("limit and offset must be integers") from None
    if limit < 1 or offset < 0:
        raise UserError("limit must be >= 1 and offset >= 0")
    return limit, offset


def _user_errors(method: Callable[..., Response]) -> Callable[..., Response]:
    """A route's UserError as a 400 naming the problem."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Response:
        try:
            return method(*args, **kwargs)
        except UserError as e:
            return error_response(400, str(e))

    return wrapper


def _checkpoint_id(kind: str, name: str) -> str:
    if kind not in CHECKPOINT_KINDS:
        raise UserError(f"unknown checkpoint type {kind!r}; expected one of {list(CHECKPOINT_KINDS)}")
    return f"{kind}/{name}"


class RunsApi:
    """Answers from the checkpoint store; never touches the ranks. One method per route (``http_app`` routes)."""

    def __init__(self, store: CheckpointStore, signer: UrlSigner | None = None) -> None:
        self.store = store
        self.signer = signer or UrlSigner()

    @_user_errors
    def list_runs(self, query: dict[str, str]) -> Response:
        limit, offset = _page(query, 20)
        runs, total = self.store.list_runs(limit, offset)
        return json_response({"training_runs": runs, "cursor": {"offset": offset, "limit": limit,
                                                                "total_count": total}})

    @_user_errors
    def list_checkpoints(self, query: dict[str, str]) -> Response:
        limit, offset = _page(query, 100)
        rows = self.store.checkpoints(limit=limit, offset=offset)
        return json_response({"checkpoints": [row.to_json() for row in rows],
                              "cursor": {"offset": offset, "limit": limit,
                                         "total_count": self.store.count_checkpoints()}})

    def run(self, run_id: str, checkpoints: bool = False) -> Response:
        run = self.store.run_json(run_id)
        if run is None:
            return error_response(404, f"unknown training run {run_id!r}")
        if not checkpoints:
            return json_response(run)
        return json_response({"checkpoints": [row.to_json() for row in self.store.checkpoints(run_id)],
                              "cursor": None})

    @_user_errors
    def delete(self, run_id: str, kind: str, name: str) -> Response:
        checkpoint_id = _checkpoint_id(kind, name)
        if not self.store.delete(run_id, checkpoint_id):
            return error_response(404, f"no checkpoint tinker://{run_id}/{checkpoint_id}")
        return json_response({})

    @_user_errors
    def set_ttl(self, run_id: str, kind: str, name: str, body: bytes) -> Response:
        checkpoint_id = _checkpoint_id(kind, name)
        try:
            ttl = parse_ttl(json.loads(body or b"{}").get("ttl_seconds"))
        except (ValueError, AttributeError):
            raise UserError("the body must be a JSON object with ttl_seconds") from None
        if not self.store.set_ttl(run_id, checkpoint_id, ttl):
            return error_response(404, f"no checkpoint tinker://{run_id}/{checkpoint_id}")
        return json_response({})

    @_user_errors
    def urls(self, run_id: str, kind: str, name: str, host: str) -> Response:
        return self._urls(run_id, _checkpoint_id(kind, name), {"host": host})

    @_user_errors
    def weights_info(self, body: bytes) -> Response:
        return self._weights_info(body)

    def _urls(self, run_id: str, checkpoint_id: str, headers: dict[str, str]) -> Response:
        row = self.store.checkpoint(run_id, checkpoint_id)
        if row is None or row.checkpoint_type != "external":
            return error_response(404, f"no external weights checkpoint tinker://{run_id}/{checkpoint_id}")
        expires = time.time() + URL_LIFETIME_S
        base_url = f"http://{headers.get('host', '127.0.0.1')}"
        files = sorted(p.relative_to(row.directory).as_posix() for p in row.directory.rglob("*") if p.is_file())
        return json_response({
            "urls": {name: self.signer.sign(base_url, run_id, checkpoint_id, name, expires) for name in files},
            "expires": datetime.fromtimestamp(expires, UTC).isoformat()})

    def _weights_info(self, body: bytes) -> Response:
        try:
            path = str(json.loads(body or b"{}").get("tinker_path", ""))
        except (ValueError, AttributeError):
            raise UserError("the body must be a JSON object with tinker_path") from None
        source = TinkerPath.parse(path, CHECKPOINT_KINDS)
        run = self.store.run_json(source.run_id)
        if run is None or self.store.checkpoint(source.run_id, source.checkpoint_id) is None:
            return error_response(404, f"no checkpoint {path}")
        lora = self.store.run_lora(source.run_id)
        return json_response({"base_model": run["base_model"], "is_lora": lora is not None,
                              "lora_rank": lora["rank"] if lora else None,
                              **{k: lora[k] if lora else None for k in ("train_unembed", "train_mlp", "train_attn")}})

    def serve_file(self, token: str) -> Response:
        """A signed URL's file: 403 if the signature is bad or expired, 404 if the checkpoint is gone."""
        signed = self.signer.verify(token)
        if signed is None:
            return error_response(403, "the download URL is invalid or has expired")
        row = self.store.checkpoint(signed.run_id, signed.checkpoint_id)
        if row is None:
            return error_response(404, "the checkpoint was deleted or has expired")
        path = (row.directory / signed.file).resolve()
        if not path.is_relative_to(row.directory.resolve()) or not path.is_file():
            return error_response(404, f"no file {signed.file!r} in the checkpoint")
        return Response(200, b"", "application/octet-stream", file=Path(path))
