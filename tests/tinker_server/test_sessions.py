"""Sessions with a lifetime, queue_state and /metrics, in-process (no ranks): what a client and an operator see."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tinker_sdk_helpers import require

require("fastapi")
require("prometheus_client")
from http_in_process import client, handle  # noqa: E402
from test_api import fwdbwd_body, post, result  # noqa: E402

from deepspeed_tinker.api import ApiSettings, TinkerApi  # noqa: E402
from deepspeed_tinker.http_app import HttpSettings  # noqa: E402
from deepspeed_tinker.scheduler import FutureStore, Scheduler  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")


@pytest.fixture
def api(tmp_path: Path) -> TinkerApi:
    # A clock that stands still: every job costs the same, so the sessions take turns (fair queuing by time).
    return TinkerApi(Scheduler(FutureStore(), clock=lambda: 0.0),
                     ApiSettings(tmp_path, long_poll_s=0.05, session_timeout_s=120))


def fwdbwd(api: TinkerApi, *args: object) -> tuple[int, dict]:
    return post(api, "forward_backward", fwdbwd_body(*args), **{"content-type": "application/x-protobuf"})


def session_with_model(api: TinkerApi) -> tuple[str, str]:
    session = post(api, "create_session", {})[1]["session_id"]
    reply = post(api, "create_model", {"session_id": session, "model_seq_id": 0, "base_model": "tiny-llama-byte",
                                       "lora_config": {"rank": 4}})[1]
    return session, reply["model_id"]


def test_heartbeats_keep_a_session_and_silence_closes_it(api: TinkerApi) -> None:
    quiet, quiet_model = session_with_model(api)
    alive, alive_model = session_with_model(api)
    while api.scheduler.next_job(timeout=0) is not None:  # the creates "ran"
        pass
    start = time.monotonic()
    api.registry.touch(quiet, start - 100)  # both last seen 100 s ago
    api.registry.touch(alive, start - 100)
    assert post(api, "session_heartbeat", {"session_id": alive})[0] == 200
    held = post(api, "optim_step", {"model_id": quiet_model, "seq_id": 2, "adam_params": {}})[1]["request_id"]
    api.registry.touch(quiet, start - 100)  # the request above counted as a sign of life; undo that
    assert api.expire_sessions(start + 30) == [quiet]
    assert api.sessions() == 1

    # Its waiting request failed, naming the timeout; its model is unloaded on the ranks (a job in its turn).
    failed = result(api, held)
    assert failed["category"] == "user" and f"session {quiet} was closed" in failed["error"]
    assert "--session-timeout-s" in failed["error"] and "no heartbeat for 130 s" in failed["error"]
    job = api.scheduler.next_job(timeout=0)
    assert (job.kind, job.model_id) == ("unload", quiet_model)

    # Later requests on it: user errors saying why; its heartbeat gets 410 (the SDK stops heartbeating).
    later = fwdbwd(api, quiet_model, 1, [1, 2, 3])[1]["request_id"]
    assert f"model {quiet_model} is gone: its session {quiet} was closed" in result(api, later)["error"]
    status, reply = post(api, "session_heartbeat", {"session_id": quiet})
    assert status == 410 and "was closed: no heartbeat" in reply["error"]
    create = post(api, "create_model", {"session_id": quiet, "model_seq_id": 1, "base_model": "tiny-llama-byte"})
    assert "was closed" in result(api, create[1]["request_id"])["error"]
    status, _ = post(api, "create_sampling_session", {"session_id": quiet, "sampling_session_seq_id": 0,
                                                      "base_model": "tiny-llama-byte"})
    assert status == 400

    # The heartbeat kept the other one, and its model still takes requests.
    assert post(api, "session_heartbeat", {"session_id": alive})[0] == 200
    ok = fwdbwd(api, alive_model, 1, [1, 2, 3])[1]["request_id"]
    assert api.futures.wait(ok, 0).status == "pending"


def test_a_timeout_of_zero_never_closes(tmp_path: Path) -> None:
    api = TinkerApi(Scheduler(FutureStore()), ApiSettings(tmp_path, session_timeout_s=0))
    session = post(api, "create_session", {})[1]["session_id"]
    assert api.expire_sessions(time.monotonic() + 10**6) == []
    assert post(api, "session_heartbeat", {"session_id": session})[0] == 200


def test_queue_state_says_when_other_sessions_are_ahead(api: TinkerApi) -> None:
    _, first = session_with_model(api)
    _, second = session_with_model(api)
    while api.scheduler.next_job(timeout=0) is not None:
        pass
    ids = [fwdbwd(api, first, seq, [1, 2])[1]["request_id"] for seq in (1, 2)]
    mine = fwdbwd(api, second, 1, [1, 2])[1]["request_id"]
    reply = result(api, mine)
    assert reply["type"] == "try_again" and reply["queue_state"] == "paused_capacity"
    assert reply["queue_state_reason"].startswith("queued behind about 1 request(s) of 1 other session(s)")
    assert result(api, ids[0])["queue_state"] == "active"
    api.scheduler.next_job(timeout=0)
    assert result(api, ids[0]) == {"type": "try_again", "request_id": ids[0], "queue_state": "active",
                                   "queue_state_reason": "running"}
    held = fwdbwd(api, second, 3, [1, 2])[1]["request_id"]
    assert "seq_id order" in result(api, held)["queue_state_reason"]


def test_metrics_in_prometheus_format(api: TinkerApi) -> None:
    session, model = session_with_model(api)
    job = api.scheduler.next_job(timeout=0)
    api.futures.resolve(job.request_id, {"model_id": model, "type": "create_model"})
    fwdbwd(api, model, 1, [1, 2, 3])
    reply = handle(api, "GET", "/metrics", {})
    assert reply.status == 200 and reply.content_type == "text/plain"
    text = reply.body.decode()
    assert f'tinker_queue_depth{{session="{session}"}} 1.0' in text
    assert 'tinker_request_latency_seconds_count{kind="create"} 1.0' in text
    assert 'tinker_requests_total{kind="create",status="ok"} 1.0' in text
    assert "tinker_sessions 1.0" in text
    assert 'tinker_tokens_per_second{kind="train"} 0.0' in text
    assert "# TYPE tinker_rank_memory_bytes gauge" in text


def test_metrics_need_a_key_when_the_server_has_keys(tmp_path: Path) -> None:
    api = TinkerApi(Scheduler(FutureStore()), ApiSettings(tmp_path))
    http = client(api, HttpSettings(api_keys=frozenset({"tml-a"})))
    assert http.get("/metrics").status_code == 401
    assert http.get("/metrics", headers={"x-api-key": "tml-b"}).status_code == 401
    assert http.get("/metrics", headers={"x-api-key": "tml-a"}).status_code == 200
    assert http.get("/metrics", headers={"authorization": "Bearer tml-a"}).status_code == 200, "Prometheus' way"
    assert json.loads(http.get("/metrics").content)["error"].startswith("an API key is required for /metrics")
    assert client(api, HttpSettings()).get("/metrics").status_code == 200, "no keys: open, like the server"
