"""A load of cheap requests over raw HTTP, as several clients send them: each session's thread sends one request
that the server refuses at validation (a finished future), retrieves its result, and goes on, at a fixed total rate.

Used by ``test_http_load.py``; run alone against a server to measure (``--help``): the documented figure (280
requests a second for two minutes on the server's default bounds) was measured so.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import statistics
import threading
import time

from tinker_sdk_helpers import API_KEY


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What the clients saw: requests sent, their HTTP statuses, the rate reached and the round trip's p50."""

    sent: int
    statuses: dict[int, int]
    seconds: float
    p50_ms: float

    @property
    def rate(self) -> float:
        return self.sent / self.seconds


class _Client:
    """One kept-alive connection speaking the server's JSON routes."""

    def __init__(self, base_url: str) -> None:
        host, port = base_url[len("http://"):].rsplit(":", 1)
        self._conn = http.client.HTTPConnection(host, int(port), timeout=60)

    def post(self, route: str, body: dict) -> tuple[int, dict]:
        self._conn.request("POST", f"/api/v1/{route}", json.dumps(body).encode(),
                           {"X-API-Key": API_KEY, "Content-Type": "application/json"})
        response = self._conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")

    def close(self) -> None:
        self._conn.close()


def _open_model(client: _Client) -> str:
    status, session = client.post("create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
    assert status == 200, session
    status, model = client.post("create_model", {"session_id": session["session_id"], "model_seq_id": 0,
                                                 "base_model": "tiny-llama-byte", "lora_config": {"rank": 4}})
    assert status == 200, model
    deadline = time.monotonic() + 300
    while client.post("retrieve_future", {"request_id": model["request_id"]})[1].get("type") == "try_again":
        assert time.monotonic() < deadline, "the model was not created in 300 s"
    return model["model_id"]


def run_load(base_url: str, rate: float, seconds: float, sessions: int) -> LoadResult:
    """``rate`` requests a second in all, for ``seconds``, spread evenly over ``sessions`` sessions, each result
    retrieved; a request that is not answered 200 (a 429) is counted under its status."""
    clients = [_Client(base_url) for _ in range(sessions)]
    models = [_open_model(client) for client in clients]
    statuses: dict[int, int] = {}
    times: list[float] = []
    lock = threading.Lock()
    start = time.monotonic()

    def send(client: _Client, model_id: str) -> None:
        period = sessions / rate
        due = start
        while due < start + seconds:
            time.sleep(max(0.0, due - time.monotonic()))
            sent = time.perf_counter()
            status, reply = client.post("optim_step", {"model_id": model_id, "seq_id": "not a number",
                                                       "adam_params": {"learning_rate": 1e-3}})
            if status == 200:
                status = client.post("retrieve_future", {"request_id": reply["request_id"]})[0]
            with lock:
                statuses[status] = statuses.get(status, 0) + 1
                times.append(time.perf_counter() - sent)
            due += period

    threads = [threading.Thread(target=send, args=pair, daemon=True) for pair in zip(clients, models)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start
    for client in clients:
        client.close()
    return LoadResult(len(times), statuses, elapsed, statistics.median(times) * 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("base_url")
    parser.add_argument("--rate", type=float, default=280.0, help="requests a second, all sessions together")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--sessions", type=int, default=4)
    args = parser.parse_args()
    result = run_load(args.base_url, args.rate, args.seconds, args.sessions)
    print(f"{result.sent} requests in {result.seconds:.1f} s ({result.rate:.0f}/s), statuses {result.statuses}, "
          f"round trip p50 {result.p50_ms:.2f} ms")


if __name__ == "__main__":
    main()
