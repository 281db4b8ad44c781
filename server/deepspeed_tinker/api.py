"""The Tinker HTTP protocol: routes, sessions, models, futures; no training here.

Every POST returns at once (work goes to the scheduler) and is idempotent: a repeated
``X-Idempotency-Key`` gets the first response again, a repeated ``(model_id, seq_id)`` the first
future. Bad input is found here, before anything reaches a rank, and reported as a ``user``
error in the future's result.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import secrets
import shutil
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .checkpoint_files import directory_size, parse_age_recipients
from .checkpoint_store import CheckpointStore, TinkerPath
from .checkpoint_store import checkpoint_dir as checkpoint_dir
from .checkpoint_store import parse_tinker_path as parse_tinker_path
from .idempotency import MAX_SAMPLE_REPLIES_PER_KEY, IdempotencyReplies
from .jobs import (
    AdamParams,
    CheckpointRecord,
    JobKind,
    LoadWeights,
    SaveExternal,
    SaveSampler,
    SaveWeights,
    WeightsMeta,
)
from .metrics import ServerMetrics
from .model import BASE_MODELS, DEFAULT_LORA_RANK, LoraSpec
from .responses import Response, error_response, json_response
from .runs_api import RunsApi, parse_ttl
from .sampling import SampleResult, SnapshotRef, encode_sample_response, parse_sample, sample_response_json
from .scheduler import Future, FutureStore, FutureStoreFull, QueuePosition, Scheduler
from .sessions import ModelRecord, SamplingSession, SessionRegistry, session_of
from .stability import StabilityRecords, resolve_provenance
from .vllm_sampler import FULL_WEIGHTS_REFUSED, VllmSampler, snapshots_folder
from .wire import (
    PROTO_CONTENT_TYPE,
    PROVENANCE_LOSSES,
    FwdBwdRequest,
    FwdBwdResult,
    UserError,
    check_against_model,
    encode_forward_backward_output,
    forward_backward_output_json,
    parse_forward_backward,
    parse_json,
    validate_forward_backward,
)

log = logging.getLogger("tinker_server")

API = "/api/v1/"
#: Default of ``--session-timeout-s``: a session without a heartbeat (the SDK sends one every 10 s) or any other
#: request for this long is closed.
DEFAULT_SESSION_TIMEOUT_S = 120.0
#: Default of ``--max-chunk-datums``: on a tiny Qwen3 on 2 CPU ranks, 64 datums of 64 tokens per step ran at 102
#: datums/s in requests of 8, 234 in requests of 32 and 240 in one of 64 (docs/tinker-server/service.md); 32 is
#: within 3 % of the best at half its per-rank activation memory and job length.
DEFAULT_MAX_CHUNK_DATUMS = 32


@dataclass(frozen=True)
class ApiSettings:
    checkpoint_root: Path
    #: Datums per forward_backward request the SDK sends at most (``--max-chunk-datums``).
    max_chunk_datums: int = DEFAULT_MAX_CHUNK_DATUMS
    #: Ask the SDK to zstd-compress forward_backward bodies (exercises that path).
    compress_fwdbwd: bool = True
    #: How long retrieve_future holds a pending request before answering try_again.
    long_poll_s: float = 10.0
    #: Where a byte-level tokenizer is written for clients (``get_info``'s ``tokenizer_id``); None: not offered.
    byte_tokenizer_dir: Path | None = None
    #: Keep only each training run's K newest training and K newest sampler checkpoints (``--keep-checkpoints``);
    #: None: keep every one (until its TTL, if any).
    keep_checkpoints: int | None = None
    #: A session without a heartbeat or request for this long is closed (``--session-timeout-s``); 0: never.
    session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S


def canonical_base_model(name: str) -> str:
    """A served model's name: built-in names as they are, local models by absolute path (``~`` and
    relative spellings of a served directory resolve to it)."""
    if name in BASE_MODELS:
        return name
    if name:
        resolved = str(Path(name).expanduser().resolve())
        if resolved in BASE_MODELS:
            return resolved
    raise UserError(f"unknown base_model {name!r}; this server has {sorted(BASE_MODELS)}")


def queue_state(position: QueuePosition | None) -> tuple[str, str]:
    """``try_again``'s ``queue_state`` and ``queue_state_reason`` for a pending request: ``paused_capacity`` while
    it waits for other sessions' work (the server is busy with other users), else ``active``."""
    if position is None:
        return "active", "running"
    if position.state == "held":
        return "active", "waiting for an earlier request of the same model (seq_id order)"
    if position.others:
        return "paused_capacity", (f"queued behind about {position.others} request(s) of {position.sessions} "
                                   f"other session(s) and {position.own} of its own (fair queuing across sessions)")
    if position.own:
        return "active", f"queued behind {position.own} earlier request(s) of its own session"
    return "active", "next to run"


def _adam_params(body: dict[str, Any]) -> AdamParams:
    """The per-step Adam hyper-parameters, validated; other optimizer families are refused."""
    if "adam_params" not in body:
        kind = (body.get("optimizer_params") or {}).get("type", "none")
        raise UserError(f"unsupported optimizer {kind!r}: this server runs AdamW (send adam_params)")
    raw = body["adam_params"]
    defaults = asdict(AdamParams())
    unknown = sorted(set(raw) - set(defaults))
    if unknown:
        raise UserError(f"unknown adam_params {unknown}")
    params = {k: float(raw.get(k, v)) for k, v in defaults.items()}
    if not all(math.isfinite(v) for v in params.values()):
        raise UserError("adam_params must be finite")
    if params["learning_rate"] < 0 or params["weight_decay"] < 0 or params["eps"] <= 0:
        raise UserError("adam_params: learning_rate and weight_decay must be >= 0 and eps > 0")
    if not (0 <= params["beta1"] < 1 and 0 <= params["beta2"] < 1):
        raise UserError("adam_params: beta1 and beta2 must be in [0, 1)")
    return AdamParams(**params)


def _weights_meta(record: ModelRecord) -> WeightsMeta:
    return WeightsMeta(record.base_model, record.lora.__dict__ if record.lora else None)


#: A POST route's handler: (headers keyed in lower case, body) -> response.
PostHandler = Callable[[dict[str, str], bytes], Response]


class TinkerApi:
    """Request handling, independent of the HTTP server so tests can call it directly."""

    def __init__(self, scheduler: Scheduler, settings: ApiSettings, vllm: VllmSampler | None = None) -> None:
        self.scheduler = scheduler
        #: With ``--sampler vllm``: samples go to vLLM, not into the ranks' queue.
        self.vllm = vllm
        self.futures: FutureStore = scheduler.futures
        self.settings = settings
        self._lock = threading.Lock()
        self.registry = SessionRegistry()
        self._replies = IdempotencyReplies()
        self._samples = IdempotencyReplies(per_key=MAX_SAMPLE_REPLIES_PER_KEY)  # "sampler:seq_id" -> first reply
        self.stability = StabilityRecords()
        self._rng = np.random.default_rng()
        self.store = CheckpointStore(settings.checkpoint_root)
        self.runs = RunsApi(self.store)
        self._last_reap = 0.0
        self.metrics = ServerMetrics(scheduler, self.sessions)
        self.futures.on_finish = self._on_finish
        self._posts: dict[str, PostHandler] = {
            "client/config": self._client_config,
            "client/dynamic_config": lambda h, b: json_response({}),
            "create_session": self._create_session,
            "session_heartbeat": self._heartbeat,
            "telemetry": lambda h, b: json_response({"status": "accepted"}),
            "create_model": self._create_model,
            "get_info": self._get_info,
            "forward_backward": self._forward_backward,
            "forward": self._forward,
            "optim_step": self._optim_step,
            "save_weights": self._save_weights,
            "load_weights": self._load_weights,
            "save_weights_for_sampler": self._save_weights_for_sampler,
            "save_weights_external": self._save_weights_external,
            "create_sampling_session": self._create_sampling_session,
            "asample": self._asample,
        }

    # ----------------------------------------------------------------- dispatch

    def post_routes(self) -> dict[str, PostHandler]:
        """The POST routes under ``/api/v1/`` and their handlers: ``http_app`` declares one route for each."""
        return dict(self._posts)

    def post(self, handler: PostHandler, headers: dict[str, str], body: bytes) -> Response:
        """One POST through its route's handler (headers keyed in lower case): an ``X-Idempotency-Key`` repeated
        with the same API key gets the first response again, a UserError is a 400 naming the problem, a full
        session or store a 429."""
        key = headers.get("x-idempotency-key")
        api_key = headers.get("x-api-key", "")
        if key and (reply := self._replies.get(api_key, key)) is not None:
            return reply
        try:
            response = handler(headers, body)
        except UserError as e:
            response = error_response(400, str(e))
        except FutureStoreFull as e:  # nothing was queued: the client may retry the same request later
            response = error_response(429, str(e))
        if key and response.status < 500 and response.status != 429:
            response = self._replies.put(api_key, key, response)
        return response

    def capabilities(self) -> Response:
        return json_response({"supported_models": [
            {"model_name": name, "max_context_length": spec.max_context_length, "trainable": True,
             "sampleable": True} for name, spec in BASE_MODELS.items()]})

    def sampler(self, sampler_id: str) -> Response:
        sampler = self.registry.find_sampler(sampler_id)
        if sampler is None:
            return error_response(404, f"unknown sampler {sampler_id!r}")
        return json_response({"sampler_id": sampler.sampling_session_id, "base_model": sampler.base_model,
                              "model_path": sampler.model_path})

    # ------------------------------------------------------------ session/model

    def _client_config(self, headers: dict[str, str], body: bytes) -> Response:
        return json_response({
            "pjwt_auth_enabled": False,
            "use_pyqwest_transport": False,  # plain httpx over HTTP/1.1 on loopback
            "parallel_fwdbwd_chunks": True,
            "proto_compress_fwdbwd": self.settings.compress_fwdbwd,
            "fwdbwd_max_chunk_len": self.settings.max_chunk_datums,
            "custom_loss_server_side": False,
        })

    def _create_session(self, headers: dict[str, str], body: bytes) -> Response:
        parse_json(body)
        session_id = self.registry.open()
        return json_response({"type": "create_session", "session_id": session_id})

    # ---------------------------------------------------------- session lifetime

    def _heartbeat(self, headers: dict[str, str], body: bytes) -> Response:
        """Keep a session alive; a closed or unknown one gets 410, on which the SDK stops its heartbeat loop."""
        session_id = str(parse_json(body).get("session_id", ""))
        if not self.registry.touch(session_id):
            return error_response(410, self.registry.gone(session_id))
        return json_response({"type": "session_heartbeat"})

    def expire_sessions(self, now: float | None = None) -> list[str]:
        """Close the sessions without a heartbeat or request for ``session_timeout_s``: their models are unloaded on
        every rank, their waiting requests fail with a user error naming the timeout, later requests on them too."""
        timeout = self.settings.session_timeout_s
        if timeout <= 0:
            return []
        now = time.monotonic() if now is None else now
        expired = self.registry.idle(now, timeout)
        for session_id, idle in expired:
            self._close_session(session_id, f"no heartbeat for {idle:.0f} s, over this server's timeout of "
                                f"{timeout:g} s (--session-timeout-s)")
        return [session_id for session_id, _ in expired]

    def _close_session(self, session_id: str, reason: str) -> int:
        """Forget a session's models and sampling sessions, fail its waiting requests, unload its models on every
        rank; the number of models unloaded."""
        model_ids = self.registry.close(session_id, reason)
        message = f"session {session_id} was closed: {reason}"
        self.scheduler.drop_session(session_id, message)
        if self.vllm is not None:
            self.vllm.cancel_session(session_id, message)
        for model_id in sorted(model_ids):  # internal: bookkeeping is never refused; in the session's turns
            self.scheduler.submit(JobKind.UNLOAD, model_id, model_id, internal=True, session=session_id)
        log.warning("closed session %s (%s): %d model(s) unloaded", session_id, reason, len(model_ids))
        return len(model_ids)

    def finish_session(self, session_id: str) -> Response:
        """The client is done with a session: its queued requests still run, then its models are unloaded."""
        model_ids = self.registry.close(session_id, "finished by its client", samplers=False)
        for model_id in model_ids:
            self.scheduler.close_model(model_id, f"session {session_id} was finished by its client before the "
                                       "seq_id this request waited behind arrived")
            self.scheduler.submit(JobKind.UNLOAD, model_id, model_id, internal=True, session=session_id)
        return json_response({})

    def sessions(self) -> int:
        """Open sessions."""
        return self.registry.count()

    def _new_model(self, body: dict[str, Any], lora: LoraSpec | None, base_model: str) -> ModelRecord:
        session_id = str(body.get("session_id", ""))
        self.registry.check(session_id)
        base_model = canonical_base_model(base_model)
        if self.vllm is not None and lora is not None and lora.rank > self.vllm.options.max_lora_rank:
            raise UserError(f"lora_config.rank {lora.rank} is over {self.vllm.options.max_lora_rank}, the largest "
                            "this server's vLLM sampler takes (--vllm-max-lora-rank)")
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise UserError(f"unsupported optimizer {optimizer!r}: this server runs AdamW")
        metadata = body.get("user_metadata")
        return ModelRecord(f"{session_id}:train:{int(body.get('model_seq_id', 0))}", session_id, base_model, lora,
                           dict(metadata) if isinstance(metadata, dict) and metadata else None)

    def _open(self, record: ModelRecord, jobs: list[tuple[JobKind, Any]]) -> Response:
        """Make a model addressable and queue the jobs that bring it up; the client waits on the last.

        A retried create (same session and ``model_seq_id``) gets the first future back. With the future store
        full it is refused (429) before anything is registered.
        """
        def create() -> str:
            self.futures.check_room(len(jobs), record.session_id)
            if not self.scheduler.open_model(record.model_id, session=record.session_id):
                raise UserError(f"model {record.model_id} already exists")
            for kind, payload in jobs:  # room checked: internal, so none is refused half-way
                request_id = self.scheduler.submit(kind, record.model_id, payload, internal=True)
            return request_id

        request_id = self.registry.add_model(record, create)
        return json_response({"request_id": request_id, "model_id": record.model_id})

    def _create_model(self, headers: dict[str, str], body: bytes) -> Response:
        request = parse_json(body)
        try:
            raw_lora = request.get("lora_config")
            lora = None
            # No lora_config: full fine-tuning, as rank 0; one without a rank: Tinker's default rank.
            rank = 0
            if isinstance(raw_lora, dict):
                rank = DEFAULT_LORA_RANK if raw_lora.get("rank") is None else int(raw_lora["rank"])
            if rank > 0:
                seed = raw_lora.get("seed")
                lora = LoraSpec(rank=rank,
                                seed=int(seed) if seed is not None else random.getrandbits(31),
                                train_attn=bool(raw_lora.get("train_attn", True)),
                                train_mlp=bool(raw_lora.get("train_mlp", True)),
                                train_unembed=bool(raw_lora.get("train_unembed", True)))
                if not lora.target_modules():
                    raise UserError("lora_config trains nothing (train_attn, train_mlp, train_unembed all false)")
            record = self._new_model(request, lora, str(request.get("base_model", "")))
            return self._open(record, [(JobKind.CREATE, record)])
        except UserError as e:
            return self._failed_future(str(e), session=str(request.get("session_id", "")))

    def _failed_future(self, message: str, category: str = "user", session: str = "") -> Response:
        return json_response({"request_id": self._failed_request(message, category, session)})

    def _failed_request(self, message: str, category: str = "user", session: str = "") -> str:
        """A request refused before it was queued, as a failed future held by ``session`` (the session the
        request names, ``""`` when none can be told); its id."""
        future = self.futures.create(session)
        self.futures.fail(future.request_id, message, category)
        return future.request_id

    def model(self, model_id: str) -> ModelRecord:
        return self.registry.model(model_id)

    def tokenizer_id(self, base_model: str) -> str | None:
        """What the SDK's ``get_tokenizer`` loads offline: the model directory, or the byte tokenizer's."""
        spec = BASE_MODELS[base_model]
        if spec.path is not None:
            return spec.path
        directory = self.settings.byte_tokenizer_dir
        return str(directory) if directory is not None else None

    def _get_info(self, headers: dict[str, str], body: bytes) -> Response:
        model_id = str(parse_json(body).get("model_id", ""))
        try:
            record = self.model(model_id)
        except UserError as e:
            return error_response(404, str(e))
        return json_response({
            "type": "get_info",
            "model_id": model_id,
            "model_data": {"arch": record.spec.model_type, "model_name": record.base_model,
                           "tokenizer_id": self.tokenizer_id(record.base_model)},
            "model_name": record.base_model,
            "is_lora": record.lora is not None,
            "lora_rank": record.lora.rank if record.lora else None,
        })

    # ------------------------------------------------------------------ training

    def _sequenced(self, model_id: str, seq_id: Any, kind: JobKind, build: Callable[[ModelRecord], Any]) -> Response:
        """Queue a model request in seq order; a user error found by ``build`` still fills its slot."""
        try:
            record = self.model(model_id)
        except UserError as e:
            return self._failed_future(str(e), session=session_of(model_id))
        self.registry.touch(record.session_id)
        if not isinstance(seq_id, int) or seq_id < 1:
            return self._failed_future(f"seq_id must be an integer >= 1, got {seq_id!r}", session=record.session_id)
        self._touch(model_id)
        rejection, payload = None, None
        try:
            payload = build(record)
        except UserError as e:
            rejection = str(e)
        try:
            request_id = self.scheduler.submit_sequenced(model_id, seq_id, kind, payload, rejection)
        except KeyError:
            return self._failed_future(f"unknown model id {model_id!r}", session=record.session_id)
        except ValueError as e:
            return self._failed_future(str(e), session=record.session_id)
        return json_response({"request_id": request_id, "model_id": model_id})

    def _touch(self, model_id: str) -> None:
        """Note the run's last request time (written at most once a second: a step can be many requests)."""
        if self.registry.run_touch_due(model_id):
            self.store.touch_run(model_id)

    def _forward_backward(self, headers: dict[str, str], body: bytes, forward_only: bool = False) -> Response:
        try:
            msg = parse_forward_backward(body, headers.get("content-type"), headers.get("content-encoding"))
        except UserError as e:  # no seq_id can be trusted: fail without touching any sequence
            return self._failed_future(str(e))
        # From here on the request has a slot: a user error fills it, so later requests still run.
        forward_only = forward_only or msg.forward_only

        def build(record: ModelRecord) -> FwdBwdRequest:
            request = validate_forward_backward(msg, forward_only)
            check_against_model(request, record.spec.vocab_size, record.spec.max_context_length)
            if request.loss_fn in PROVENANCE_LOSSES:  # the sampler's record, named by the datums' provenance
                request = replace(request, data=tuple(resolve_provenance(d, i, self.stability, record.session_id)
                                                      for i, d in enumerate(request.data)))
            return request

        kind = JobKind.FORWARD if forward_only else JobKind.FORWARD_BACKWARD
        return self._sequenced(msg.model_id, int(msg.seq_id), kind, build)

    def _forward(self, headers: dict[str, str], body: bytes) -> Response:
        return self._forward_backward(headers, body, forward_only=True)

    def _optim_step(self, headers: dict[str, str], body: bytes) -> Response:
        request = parse_json(body)
        return self._sequenced(str(request.get("model_id", "")), request.get("seq_id"), JobKind.OPTIM_STEP,
                               lambda record: _adam_params(request))

    def _save_weights(self, headers: dict[str, str], body: bytes) -> Response:
        request = parse_json(body)
        model_id = str(request.get("model_id", ""))

        def build(record: ModelRecord) -> SaveWeights:
            path = TinkerPath.new(model_id, "weights", str(request.get("path") or f"step-{request.get('seq_id')}"))
            directory = path.directory(self.settings.checkpoint_root)
            return SaveWeights(str(directory), str(path), bool(request.get("overwrite", False)),
                               _weights_meta(record), self._checkpoint_record(request, path, directory))

        return self._sequenced(model_id, request.get("seq_id"), JobKind.SAVE_WEIGHTS, build)

    @staticmethod
    def _checkpoint_record(request: dict[str, Any], path: TinkerPath, directory: Path) -> CheckpointRecord:
        """What ``record_checkpoint`` records once the save is complete: TTL and metadata, checked now."""
        metadata = request.get("user_metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise UserError("user_metadata must be an object")
        return CheckpointRecord(path.run_id, path.checkpoint_id, str(directory), parse_ttl(request.get("ttl_seconds")),
                                metadata or None)

    def _listed(self, model_id: str, checkpoint_id: str) -> bool:
        """Whether a checkpoint exists: recorded and not expired (what is not listed cannot be loaded)."""
        return self.store.checkpoint(model_id, checkpoint_id) is not None

    def _load_source(self, path: str) -> tuple[Path, dict[str, Any]]:
        source = TinkerPath.parse(path)
        directory = source.directory(self.settings.checkpoint_root)
        meta_file = directory / "tinker_meta.json"
        if not meta_file.is_file() or not self._listed(source.run_id, source.checkpoint_id):
            raise UserError(f"no checkpoint at {path}")
        return directory, json.loads(meta_file.read_text())

    def _load_weights(self, headers: dict[str, str], body: bytes) -> Response:
        request = parse_json(body)
        optimizer = bool(request.get("optimizer", False))
        if request.get("session_id") is not None:  # create-via-load: the model's first request
            try:
                directory, meta = self._load_source(str(request.get("path", "")))
                lora = LoraSpec(**meta["lora"]) if meta.get("lora") else None
                record = self._new_model(request, lora, request.get("base_model") or meta["base_model"])
                if record.base_model != meta["base_model"]:
                    raise UserError(f"checkpoint is for {meta['base_model']}, not {record.base_model}")
                load = LoadWeights(str(directory), str(request["path"]), optimizer)
                return self._open(record, [(JobKind.CREATE, record), (JobKind.LOAD_WEIGHTS, load)])
            except UserError as e:
                return self._failed_future(str(e), session=str(request.get("session_id", "")))

        def build(record: ModelRecord) -> LoadWeights:
            directory, meta = self._load_source(str(request.get("path", "")))
            if meta["base_model"] != record.base_model or (meta.get("lora") or None) != (
                    record.lora.__dict__ if record.lora else None):
                raise UserError("checkpoint does not match this model's base model and LoRA config")
            return LoadWeights(str(directory), str(request["path"]), optimizer)

        return self._sequenced(str(request.get("model_id", "")), request.get("seq_id"), JobKind.LOAD_WEIGHTS, build)

    # ------------------------------------------------------------------ sampling

    def _save_weights_for_sampler(self, headers: dict[str, str], body: bytes) -> Response:
        """Snapshot the training weights, in the model's seq order: under a name (a path for
        ``create_sampling_client``) or, without one, as a new sampling session."""
        request = parse_json(body)
        model_id = str(request.get("model_id", ""))
        snapshot_id = f"snap-{secrets.token_hex(8)}"

        def build(record: ModelRecord) -> SaveSampler:
            lora = record.lora.__dict__ if record.lora else None
            if request.get("path"):
                path = TinkerPath.new(model_id, "sampler_weights", str(request["path"]))
                directory = path.directory(self.settings.checkpoint_root)
                return SaveSampler(str(path), {"path": str(path), "type": "save_weights_for_sampler"}, str(directory),
                                   _weights_meta(record), self._checkpoint_record(request, path, directory))
            seq = request.get("sampling_session_seq_id")
            if not isinstance(seq, int):
                raise UserError("save_weights_for_sampler needs a path (name) or a sampling_session_seq_id")
            session_id = f"{record.session_id}:sample:{seq}"
            reply = {"sampling_session_id": session_id, "type": "save_weights_for_sampler"}
            if self.vllm is None:
                self.registry.add_sampler(SamplingSession(session_id, record.base_model, None,
                                                          SnapshotRef(snapshot_id, record.base_model, lora)))
                return SaveSampler(snapshot_id, reply)
            # vLLM loads a snapshot as a PEFT adapter from disk: written beside the model's checkpoints, unlisted.
            if lora is None:
                raise UserError(FULL_WEIGHTS_REFUSED)
            directory = self.vllm.snapshot_dir(self.settings.checkpoint_root, model_id, snapshot_id)
            snapshot = SnapshotRef(snapshot_id, record.base_model, lora, str(directory))
            self.registry.add_sampler(SamplingSession(session_id, record.base_model, None, snapshot))
            return SaveSampler(snapshot_id, reply, str(directory), _weights_meta(record))

        return self._sequenced(model_id, request.get("seq_id"), JobKind.SAVE_SAMPLER, build)

    def _save_weights_external(self, headers: dict[str, str], body: bytes) -> Response:
        """Export the training weights in Hugging Face formats (a PEFT adapter for LoRA, a model directory for
        full fine-tuning), optionally age-encrypted, for download through signed URLs."""
        request = parse_json(body)
        model_id = str(request.get("model_id", ""))

        def build(record: ModelRecord) -> SaveExternal:
            path = TinkerPath.new(model_id, "external_weights", str(request.get("path") or ""))
            recipients = request.get("age_encryption_recipients")
            if recipients is not None:
                if not isinstance(recipients, list) or not 1 <= len(recipients) <= 10:
                    raise UserError("age_encryption_recipients must be a list of 1 to 10 recipients")
                try:
                    parse_age_recipients([str(r) for r in recipients])
                except ValueError as e:
                    raise UserError(str(e)) from None
            directory = path.directory(self.settings.checkpoint_root)
            tokenizer = self.tokenizer_id(record.base_model)
            return SaveExternal(str(directory), record.base_model, tokenizer,
                                tuple(str(r) for r in recipients) if recipients else None,
                                {"path": str(path), "type": "save_weights_external"},
                                self._checkpoint_record(request, path, directory))

        return self._sequenced(model_id, request.get("seq_id"), JobKind.SAVE_EXTERNAL, build)

    # ------------------------------------------------------------ after jobs

    # ------------------------------------------------------------ after jobs (commands.Recorder)

    def record_run(self, record: ModelRecord) -> None:
        """A training model was created on every rank: list its training run."""
        self.store.add_run(record.model_id, record.base_model, record.lora.__dict__ if record.lora else None,
                           record.user_metadata)

    def record_checkpoint(self, checkpoint: CheckpointRecord) -> None:
        """A save is complete on every rank: list the checkpoint, then prune the run's older ones."""
        directory = Path(checkpoint.dir)
        self.store.add_checkpoint(checkpoint.run_id, checkpoint.checkpoint_id, directory, directory_size(directory),
                                  checkpoint.ttl_seconds, checkpoint.user_metadata)
        self.prune_checkpoints(checkpoint.run_id)

    def forget_model(self, model_id: str) -> None:
        """A model was unloaded: its unnamed sampler snapshots' adapters (``--sampler vllm``) go with it."""
        shutil.rmtree(snapshots_folder(self.settings.checkpoint_root, model_id), ignore_errors=True)

    def forget_checkpoint(self, checkpoint: CheckpointRecord) -> None:
        """A save is about to replace this checkpoint: unlisted first, so nobody loads it half written."""
        self.store.forget(checkpoint.run_id, checkpoint.checkpoint_id)

    def prune_checkpoints(self, run_id: str | None = None) -> list[str]:
        """Rank 0's job loop, after a save and at start-up: with ``keep_checkpoints`` set, delete the checkpoints
        beyond each run's (or ``run_id``'s) K newest training and K newest sampler checkpoints."""
        if self.settings.keep_checkpoints is None:
            return []
        return self.store.prune(self.settings.keep_checkpoints, run_id)

    def reap_expired(self, every_s: float = 1.0) -> list[str]:
        """Rank 0's job loop, between jobs (never during a save): delete expired checkpoints, close the sessions
        past their heartbeat timeout (``expire_sessions``)."""
        now = time.monotonic()
        if now - self._last_reap < every_s:
            return []
        self._last_reap = now
        self.expire_sessions(now)
        return self.store.reap()

    def _snapshot_for_path(self, path: str) -> tuple[str, SnapshotRef]:
        """(base model, weights) of a ``tinker://`` path; a path this server does not have becomes a
        reference that fails, as a user error, when sampled."""
        try:
            source = TinkerPath.parse(path, ("sampler_weights", "weights"))
        except UserError as e:
            return "", SnapshotRef(path, "", error=str(e))
        directory = source.directory(self.settings.checkpoint_root)
        meta_file = directory / ("tinker_sampler_meta.json" if source.segment == "sampler_weights" else
                                 "tinker_meta.json")
        if not meta_file.is_file() or not self._listed(source.run_id, source.checkpoint_id):
            return "", SnapshotRef(path, "", error=f"unknown sampler path {path}: no weights saved there")
        meta = json.loads(meta_file.read_text())
        if meta.get("base_model") not in BASE_MODELS:
            return "", SnapshotRef(path, "", error=f"{path} is for base model {meta.get('base_model')!r}, which this "
                                   "server does not serve")
        return meta["base_model"], SnapshotRef(path, meta["base_model"], meta.get("lora"), str(directory))

    def _snapshot_for(self, model_path: Any, base_model: Any) -> tuple[str, SnapshotRef]:
        if model_path:
            return self._snapshot_for_path(str(model_path))
        try:
            name = canonical_base_model(str(base_model or ""))
        except UserError as e:
            return "", SnapshotRef("", "", error=str(e))
        return name, SnapshotRef(f"base:{name}", name)

    def _create_sampling_session(self, headers: dict[str, str], body: bytes) -> Response:
        request = parse_json(body)
        session_id = str(request.get("session_id", ""))
        self.registry.check(session_id)
        sampler_id = f"{session_id}:sample:{int(request.get('sampling_session_seq_id', 0))}"
        base_model, snapshot = self._snapshot_for(request.get("model_path"), request.get("base_model"))
        self.registry.add_sampler(SamplingSession(sampler_id, base_model or str(request.get("base_model") or ""),
                                               request.get("model_path"), snapshot))
        return json_response({"type": "create_sampling_session", "sampling_session_id": sampler_id})

    def _asample(self, headers: dict[str, str], body: bytes) -> Response:
        """Queue a sample; a retried ``(sampling_session_id, seq_id)`` gets its first reply."""
        request = parse_json(body)
        sampler_id = request.get("sampling_session_id")
        num = request.get("num_samples", 1)
        api_key = headers.get("x-api-key", "")
        key = f"{sampler_id}:{request.get('seq_id')}" if sampler_id is not None else None
        if key is not None and (reply := self._samples.get(api_key, key)) is not None:
            return reply
        sequence_ids = [f"{sampler_id}:{request.get('seq_id')}:{i}" for i in range(num if isinstance(num, int)
                                                                                  and 0 < num <= 256 else 1)]
        try:
            sampler = self.registry.sampler(str(sampler_id)) if sampler_id is not None else None
            if sampler is not None:
                self.registry.touch(session_of(sampler.sampling_session_id))
                base_model, snapshot = sampler.base_model, sampler.snapshot
            else:
                base_model, snapshot = self._snapshot_for(request.get("model_path"), request.get("base_model"))
            spec = BASE_MODELS.get(base_model)
            if spec is None:
                raise UserError(snapshot.error or f"unknown base_model {base_model!r}")
            with self._lock:  # a numpy Generator is not thread-safe; handlers run on many threads
                fallback_seed = int(self._rng.integers(0, 2**62))
            job = parse_sample(request, snapshot, spec.vocab_size, spec.max_context_length, spec.eos_token_ids,
                               fallback_seed)
            if request.get("record_stability_info"):
                if sampler is None:
                    raise UserError("record_stability_info needs a sampling session (its session owns the records)")
            owner, session = str(sampler_id or base_model), session_of(str(sampler_id)) if sampler_id else ""
            if self.vllm is not None:
                request_id = self.vllm.submit(job, session, owner)
            else:
                request_id = self.scheduler.submit(JobKind.SAMPLE, owner, job, session=session)
            if request.get("record_stability_info"):
                self.stability.record(session_of(str(sampler_id)), sequence_ids, request_id, job.prompt)
                finished = self.futures.wait(request_id, 0)
                if finished is not None and finished.status != "pending":  # before it was recorded: settle it now
                    self.stability.finished(request_id, finished.result)
        except UserError as e:
            request_id = self._failed_request(str(e), session=session_of(str(sampler_id)))
        response = json_response({"request_id": request_id, "sample_sequence_ids": sequence_ids})
        if key is not None:
            response = self._samples.put(api_key, key, response)
        return response

    def _on_finish(self, future: Future) -> None:
        self.stability.finished(future.request_id, future.result if isinstance(future.result, SampleResult) else None)
        self.metrics.observe(future)

    # ------------------------------------------------------------------- futures

    async def retrieve_future(self, request_id: str, accept: str) -> Response:
        """A future's result, or ``try_again`` once it has been pending for ``long_poll_s`` (awaited: a long poll
        holds no thread)."""
        future = await self.futures.wait_async(request_id, self.settings.long_poll_s)
        if future is None:
            return error_response(404, f"unknown request_id {request_id!r}")
        if future.session:  # a client waiting for its results is alive, heartbeat or not
            self.registry.touch(future.session)
        if future.status == "pending":
            state, reason = queue_state(self.scheduler.position(request_id))
            return json_response({"type": "try_again", "request_id": request_id, "queue_state": state,
                                  "queue_state_reason": reason})
        self.futures.retrieved(request_id)  # freed after a grace for the SDK's retries, not held for the whole TTL
        if future.status == "error":
            return json_response({"error": future.error, "category": future.category})
        if isinstance(future.result, (SampleResult, FwdBwdResult)):  # encoding a large result: off the event loop
            return await asyncio.to_thread(self.result_response, future.result, accept)
        return self.result_response(future.result, accept)

    @staticmethod
    def result_response(result: Any, accept: str) -> Response:
        """A finished future's result in the encoding the client accepts (protobuf or JSON)."""
        if isinstance(result, SampleResult):
            if PROTO_CONTENT_TYPE in accept:
                return Response(200, encode_sample_response(result), PROTO_CONTENT_TYPE)
            return json_response(sample_response_json(result))
        if isinstance(result, FwdBwdResult):
            if PROTO_CONTENT_TYPE in accept:
                return Response(200, encode_forward_backward_output(result), PROTO_CONTENT_TYPE)
            return json_response(forward_backward_output_json(result))
        return json_response(result)
