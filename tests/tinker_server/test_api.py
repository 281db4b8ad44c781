"""The protocol layer in-process: endpoints, idempotency, user errors (no ranks, no DeepSpeed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tinker_sdk_helpers import require

require("tinker")
from http_in_process import handle  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from deepspeed_tinker.api import ApiSettings, TinkerApi  # noqa: E402
from deepspeed_tinker.scheduler import FutureStore, Scheduler  # noqa: E402
from deepspeed_tinker.wire import FwdBwdResult  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")
KEY = {"x-api-key": "tml-test"}


@pytest.fixture
def api(tmp_path: Path) -> TinkerApi:
    return TinkerApi(Scheduler(FutureStore()), ApiSettings(tmp_path, long_poll_s=0.05))


def post(api: TinkerApi, route: str, body: dict | bytes, **headers: str):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = handle(api, "POST", f"/api/v1/{route}", {**KEY, **headers}, raw)
    return response.status, (json.loads(response.body) if response.content_type == "application/json" else response)


def result(api: TinkerApi, request_id: str, **headers: str):
    return post(api, "retrieve_future", {"request_id": request_id}, **headers)[1]


def fwdbwd_body(model_id: str, seq_id: int, tokens: list[int], loss_fn: str = "cross_entropy") -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[types.Datum(
            model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": tokens})],
            loss_fn=loss_fn), model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def new_model(api: TinkerApi) -> str:
    session = post(api, "create_session", {"tags": [], "user_metadata": {}, "sdk_version": "x"})[1]["session_id"]
    status, reply = post(api, "create_model", {"session_id": session, "model_seq_id": 0,
                                               "base_model": "tiny-llama-byte", "lora_config": {"rank": 4}})
    assert status == 200
    return reply["model_id"]


def executed(api: TinkerApi) -> list[str]:
    kinds = []
    while (job := api.scheduler.next_job(timeout=0)) is not None:
        kinds.append(job.kind)
    return kinds


def test_requires_a_tml_key(api: TinkerApi) -> None:
    assert handle(api, "POST", "/api/v1/create_session", {}, b"{}").status == 401
    assert handle(api, "GET", "/api/v1/healthz", {"x-api-key": "sk-1"}, b"").status == 401
    assert handle(api, "GET", "/api/v1/healthz", KEY, b"").status == 200


def test_client_config_and_optional_endpoints(api: TinkerApi) -> None:
    config = post(api, "client/config", {"sdk_version": "0.38.0"})[1]
    assert config["use_pyqwest_transport"] is False and config["pjwt_auth_enabled"] is False
    assert post(api, "telemetry", {"events": []}) == (200, {"status": "accepted"})
    session = post(api, "create_session", {})[1]["session_id"]
    assert post(api, "session_heartbeat", {"session_id": session})[0] == 200
    status, body = post(api, "session_heartbeat", {"session_id": "s"})
    assert status == 410 and "unknown session 's'" in body["error"], "the SDK stops heartbeating on 410"
    assert post(api, "no_such_thing", {})[0] == 404


def test_idempotency_key_replays_the_first_response(api: TinkerApi) -> None:
    first = post(api, "create_session", {}, **{"x-idempotency-key": "k1"})
    assert post(api, "create_session", {}, **{"x-idempotency-key": "k1"}) == first
    assert post(api, "create_session", {}, **{"x-idempotency-key": "k2"}) != first


def test_idempotency_replies_are_kept_per_api_key(api: TinkerApi) -> None:
    first = post(api, "create_session", {}, **{"x-idempotency-key": "k1"})
    other = post(api, "create_session", {}, **{"x-idempotency-key": "k1", "x-api-key": "tml-other"})
    assert other != first, "another tenant's request with the same idempotency key is its own request"
    assert post(api, "create_session", {}, **{"x-idempotency-key": "k1", "x-api-key": "tml-other"}) == other


def test_session_and_request_ids_are_unguessable(api: TinkerApi) -> None:
    """A request id is all ``retrieve_future`` asks for, a session id all its models' ids start with: a counter or
    a seeded generator would let one tenant read another's results."""
    import random
    import re

    sessions, requests = [], []
    model = new_model(api)
    for seq_id in (1, 2):
        random.seed(0)  # the same state of Python's generator (and numpy's) before each: the ids must still differ
        np.random.seed(0)
        sessions.append(post(api, "create_session", {})[1]["session_id"])
        requests.append(post(api, "optim_step", {"model_id": model, "seq_id": seq_id,
                                                 "adam_params": {"learning_rate": 1e-3}})[1]["request_id"])
    assert sessions[0] != sessions[1] and all(re.fullmatch(r"s[0-9a-f]{16}", s) for s in sessions), sessions
    assert requests[0] != requests[1] and all(re.fullmatch(r"req-[0-9a-f]{24}", r) for r in requests), requests


def test_one_api_keys_flood_of_idempotency_keys_pushes_out_only_its_own_replies() -> None:
    from deepspeed_tinker.idempotency import IdempotencyReplies
    from deepspeed_tinker.responses import json_response

    replies = IdempotencyReplies(per_key=3, api_keys=2)
    kept = json_response({"kept": True})
    replies.put("tml-a", "k", kept)
    for i in range(10):  # tenant b's flood
        replies.put("tml-b", f"k{i}", json_response({"i": i}))
    assert replies.get("tml-a", "k") is kept
    assert replies.get("tml-b", "k0") is None and replies.get("tml-b", "k9") is not None
    assert replies.get("tml-b", "k") is None
    replies.put("tml-c", "k", kept)  # a third key: the least recently used key's replies go
    assert replies.get("tml-a", "k") is None and replies.get("tml-b", "k9") is not None


def test_a_retried_create_model_is_the_same_model(api: TinkerApi) -> None:
    session = post(api, "create_session", {})[1]["session_id"]
    body = {"session_id": session, "model_seq_id": 3, "base_model": "tiny-llama-byte"}
    assert post(api, "create_model", body) == post(api, "create_model", body)
    assert executed(api) == ["create"]


def test_user_errors_land_in_the_future(api: TinkerApi) -> None:
    model_id = new_model(api)
    assert executed(api) == ["create"]
    proto = {"content-type": "application/x-protobuf"}
    cases = {
        "unknown model": post(api, "forward_backward", fwdbwd_body("nope", 1, [1, 2]), **proto),
        "malformed": post(api, "forward_backward", b"\xff\x00garbage", **proto),
        "vocabulary": post(api, "forward_backward", fwdbwd_body(model_id, 1, [1, 300]), **proto),
        "loss": post(api, "forward_backward", fwdbwd_body(model_id, 2, [1, 2], "ppo"), **proto),
        "optimizer": post(api, "optim_step", {"model_id": model_id, "seq_id": 3,
                                              "optimizer_params": {"type": "dimuon"}}),
        "checkpoint name": post(api, "save_weights", {"model_id": model_id, "seq_id": 4, "path": "../escape"}),
        "base model": post(api, "create_model", {"session_id": "nope", "model_seq_id": 0, "base_model": "gpt-9"}),
    }
    for name, (status, reply) in cases.items():
        assert status == 200, name
        failure = result(api, reply["request_id"])
        assert failure["category"] == "user" and failure["error"], (name, failure)
    assert executed(api) == [], "no rejected request reaches the ranks"
    post(api, "forward_backward", fwdbwd_body(model_id, 5, [1, 2]), **proto)
    assert executed(api) == ["forward_backward"], "the rejected requests filled seq 1..4"


def test_retrieve_future_long_polls_and_encodes_protobuf(api: TinkerApi) -> None:
    future = api.futures.create("s")
    assert result(api, future.request_id)["type"] == "try_again"
    assert post(api, "retrieve_future", {"request_id": "req-404"})[0] == 404
    api.futures.resolve(future.request_id, FwdBwdResult((np.array([-1.0], np.float32), ),
                                                        (np.array([1.0], np.float32), )))
    assert result(api, future.request_id)["metrics"] == {"loss:sum": 1.0}
    proto = result(api, future.request_id, accept="application/x-protobuf")
    assert proto.content_type == "application/x-protobuf" and proto.body


def test_lora_rank_defaults_to_tinkers(api: TinkerApi) -> None:
    """A ``lora_config`` without a rank gets Tinker's default rank (32, the SDK's default too); rank 0 or no
    ``lora_config`` is full fine-tuning."""
    session = post(api, "create_session", {"tags": [], "user_metadata": {}, "sdk_version": "x"})[1]["session_id"]
    ranks = []
    for seq, lora in enumerate(({}, {"rank": None, "seed": 1}, {"rank": 8}, {"rank": 0}, None)):
        body = {"session_id": session, "model_seq_id": seq, "base_model": "tiny-llama-byte"}
        if lora is not None:
            body["lora_config"] = lora
        status, reply = post(api, "create_model", body)
        assert status == 200
        record = api.model(reply["model_id"])
        ranks.append(record.lora.rank if record.lora else 0)
    assert ranks == [32, 32, 8, 0, 0]
