"""The HTTP stack on real ranks: keep-alive latency, the body limit, long polls that hold no thread, API keys, the
bounded future store.

One 2-rank server (ZeRO stage 1) with a 1 MiB body limit, 5 s long polls and a small future store (64, results
kept 4 s) serves the module; clients speak raw HTTP on loopback.
"""

from __future__ import annotations

import http.client
import json
import re
import select
import socket
import statistics
import threading
import time
from typing import Iterator

import numpy as np
import pytest
from tinker_sdk_helpers import API_KEY, fwdbwd_proto, log_tail, poll_once, post, random_data, require, result, served

pytestmark = pytest.mark.pr("zero-0-1")
LIMIT = 1 << 20
LONG_POLL_S = 5.0
MAX_FUTURES = 64
FUTURE_TTL_S = 4.0


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    require("tinker")
    tmp_dir = tmp_path_factory.mktemp("tinker-http")
    options = ("--max-body-bytes", str(LIMIT), "--long-poll-s", str(LONG_POLL_S), "--max-futures", str(MAX_FUTURES),
               "--future-ttl-s", str(FUTURE_TTL_S))
    with served(tmp_dir, 1, extra_args=options) as server:
        yield server


def connection(base_url: str) -> http.client.HTTPConnection:
    host, port = base_url[len("http://"):].rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=60)


def get_healthz(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/api/v1/healthz", headers={"X-API-Key": API_KEY})
    response = conn.getresponse()
    response.read()
    return response.status


def rank0_pid(server) -> int:
    """Rank 0's process (it serves HTTP), from the start-up line ``serving <url> (pid N)``."""
    match = re.search(r"serving \S+ \(pid (\d+)\)", server.log_path.read_text(errors="replace"))
    assert match, log_tail(server)
    return int(match.group(1))


def test_keep_alive_requests_take_about_a_millisecond(limited_server) -> None:
    """A cheap GET on one kept-alive connection (how the SDK's pool talks): p50 at most 5 ms (measured ~0.6 ms on
    2 loaded cores; the standard-library server took 44 ms, the client's delayed ACK of a two-part response)."""
    conn = connection(limited_server.base_url)
    for _ in range(20):  # warm-up
        assert get_healthz(conn) == 200
    times = []
    for _ in range(200):
        start = time.perf_counter()
        assert get_healthz(conn) == 200
        times.append(time.perf_counter() - start)
    conn.close()
    p50 = statistics.median(times) * 1000
    assert p50 <= 5.0, f"keep-alive p50 {p50:.2f} ms"


def test_a_body_over_the_limit_gets_413_and_the_server_stays_up(limited_server) -> None:
    # Declared too large: refused from the header, before any of it is sent (nothing is read).
    conn = connection(limited_server.base_url)
    conn.putrequest("POST", "/api/v1/create_session")
    conn.putheader("X-API-Key", API_KEY)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(64 << 30))
    conn.endheaders()
    response = conn.getresponse()
    reply = json.loads(response.read())
    assert response.status == 413 and str(LIMIT) in reply["error"] and reply["category"] == "user"
    conn.close()

    # Chunked, no length: refused once more than the limit has arrived (read as soon as it comes: the server
    # closes the connection after its 413, so a client still sending would be reset).
    host, port = limited_server.base_url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST /api/v1/create_session HTTP/1.1\r\nHost: {host}\r\nX-API-Key: {API_KEY}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"
        for _ in range(4 * LIMIT // 65536):
            if select.select([sock], [], [], 0.05)[0]:
                break
            sock.sendall(chunk)
        reply = b""
        while b"}" not in reply:  # the JSON body's end (the server closes the connection after it)
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    text = reply.decode(errors="replace")
    assert text.startswith("HTTP/1.1 413") and str(LIMIT) in text, text[:400]

    # A body under the limit is served, and so is everything after.
    padded = {"tags": ["x" * (LIMIT // 2)], "user_metadata": {}, "sdk_version": "0.38.0"}
    assert "session_id" in post(limited_server.base_url, "create_session", padded)
    assert get_healthz(connection(limited_server.base_url)) == 200


def test_long_polls_hold_no_thread(limited_server) -> None:
    """Many clients long-polling a pending future at once: rank 0 answers each with try_again after the long poll,
    serves other requests meanwhile, and starts no thread per poll."""
    psutil = require("psutil")
    base_url = limited_server.base_url
    session = post(base_url, "create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
    model = post(base_url, "create_model", {"session_id": session["session_id"], "model_seq_id": 0,
                                            "base_model": "tiny-llama-byte", "lora_config": {"rank": 4}})
    assert result(base_url, model["request_id"]).get("type") != "try_again"  # created: the ranks are idle again
    # seq_id 2 before seq_id 1: held back, so its future stays pending for as long as the test needs.
    pending = post(base_url, "optim_step", {"model_id": model["model_id"], "seq_id": 2,
                                            "adam_params": {"learning_rate": 1e-3}})["request_id"]
    rank0 = psutil.Process(rank0_pid(limited_server))
    before = rank0.num_threads()
    replies: list[dict] = []
    polls = 64

    def poll() -> None:
        replies.append(post(base_url, "retrieve_future", {"request_id": pending}))

    threads = [threading.Thread(target=poll) for _ in range(polls)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the polls are being held (for LONG_POLL_S)
    during = rank0.num_threads()
    assert get_healthz(connection(base_url)) == 200
    assert not replies, "a request waited behind the long polls"
    for thread in threads:
        thread.join()
    assert len(replies) == polls and all(r.get("type") == "try_again" for r in replies), replies[:3]
    assert during - before < 8, f"rank 0 went from {before} to {during} threads during {polls} long polls"
    post(base_url, f"sessions/{session['session_id']}/finish", {})


def test_only_the_servers_key_is_accepted(limited_server) -> None:
    """The server was given one key (``start_server``'s keys file): any other gets 401, and the SDK raises."""
    tinker = require("tinker")
    session = {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}
    assert "session_id" in post(limited_server.base_url, "create_session", session)
    for key in ("tml-not-given", API_KEY + "x"):
        reply = post(limited_server.base_url, "create_session", session, **{"X-API-Key": key})
        assert reply["http_status"] == 401 and reply["category"] == "user", reply
    with pytest.raises(tinker.AuthenticationError, match="unknown API key"):
        tinker.RestClient(base_url=limited_server.base_url, api_key="tml-not-given").get_server_capabilities().result()
    assert "accepting 1 API key(s); any other key gets 401" in limited_server.log_path.read_text(errors="replace")


def test_one_sessions_flood_gets_429_and_leaves_the_others_and_its_own_held_work_served(limited_server) -> None:
    """Past its share of ``--max-futures`` (a quarter by default) a session's new work gets 429 naming the limit;
    another session's ``create_model`` and ``forward`` are served at once, and the flooding session's request that
    fills the ``seq_id`` a held-back request waits behind is let in (it releases accepted work), so both run."""
    base_url = limited_server.base_url
    adam = {"adam_params": {"learning_rate": 1e-3}}

    def open_model(seq: int = 0) -> dict:
        session = post(base_url, "create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
        model = post(base_url, "create_model", {"session_id": session["session_id"], "model_seq_id": seq,
                                                "base_model": "tiny-llama-byte", "lora_config": {"rank": 4}})
        assert "error" not in result(base_url, model["request_id"])
        return {**session, **model}

    flooder = open_model()
    held = post(base_url, "optim_step", {"model_id": flooder["model_id"], "seq_id": 2, **adam})["request_id"]
    for sent in range(4 * MAX_FUTURES):  # each refused at validation: a failed future, kept for the TTL
        reply = post(base_url, "optim_step", {"model_id": flooder["model_id"], "seq_id": "x", **adam})
        if reply.get("http_status") == 429:
            break
    assert reply.get("http_status") == 429, reply
    assert f"the limit per session is {MAX_FUTURES // 4} (--max-futures-per-session)" in reply["error"], reply
    assert sent < MAX_FUTURES // 4, "refused at the session's bound, before the store is full"

    start = time.monotonic()
    other = open_model()
    data = random_data(np.random.default_rng(0), 2)
    forward = post(base_url, "forward", fwdbwd_proto(other["model_id"], 1, data, forward_only=True))
    assert "error" not in result(base_url, forward["request_id"]), "the other session is served"
    assert time.monotonic() - start < FUTURE_TTL_S, "at once, not once the flood's results expire"

    assert poll_once(base_url, held)["type"] == "try_again", "the held-back request survived the flood"
    first = post(base_url, "forward_backward", fwdbwd_proto(flooder["model_id"], 1, data))
    assert "request_id" in first, f"the slot that releases accepted work is never refused: {first}"
    assert "error" not in result(base_url, first["request_id"])
    assert "error" not in result(base_url, held)
    for session in (flooder, other):
        post(base_url, f"sessions/{session['session_id']}/finish", {})


def test_each_rank_logs_its_intra_op_threads(limited_server) -> None:
    """Every rank takes the thread count its environment gives it (the launcher's, as ``rank_env`` writes it: the
    tests' OMP_NUM_THREADS, or the rank's share of the cores) and says so, and why, at start-up."""
    from deepspeed_tinker.threads import intra_op_threads
    from local_ranks.ranks import rank_env

    threads, why = intra_op_threads(None, rank_env(0, 2, None, cpu=True))
    lines = re.findall(r"rank (\d): (\d+) intra-op thread\(s\) \((.+)\)", limited_server.log_path.read_text())
    assert sorted(lines) == [("0", str(threads), why), ("1", str(threads), why)], lines
