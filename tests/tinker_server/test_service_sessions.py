"""Sessions with a lifetime and fair scheduling on real ranks: a dropped client's memory returns, two clients
interleave, /metrics reports it (a 2-rank server of its own, with a short session timeout)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from tinker_sdk_helpers import (
    API_KEY,
    RESULT_TIMEOUT_S,
    poll_once,
    post,
    random_data,
    require,
    result,
    start_server,
    stop_server,
    to_sdk,
)

require("tinker")
require("prometheus_client")
import psutil  # noqa: E402
import tinker  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tinker import types  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")

#: Above the SDK's heartbeat period (10 s), so a live client keeps its session; short, so the test is.
SESSION_TIMEOUT_S = 12
BASE = "small-llama-byte"


@pytest.fixture(scope="module")
def service_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    require("tinker")
    tmp_dir = tmp_path_factory.mktemp("tinker-service")
    server = start_server(tmp_dir, 1, extra_args=("--session-timeout-s", str(SESSION_TIMEOUT_S)))
    try:
        yield server
    finally:
        stop_server(server)


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    request = urllib.request.Request(f"{base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def engines_bytes(base_url: str, kind: str = "engines") -> list[float]:
    """Each rank's tracked engine memory (parameters, gradients, optimizer state), or another kind of its memory."""
    metrics = scrape(base_url)
    return [metrics[("tinker_rank_memory_bytes", (("kind", kind), ("rank", str(rank))))] for rank in (0, 1)]


def ranks_rss(server) -> int:
    """The resident memory of the server's processes (the launcher and its ranks), as the OS counts it."""
    root = psutil.Process(server.process.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def wait_until(condition, timeout_s: float, what: str, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"not after {timeout_s} s: {what}"
        time.sleep(every_s)


def settled(server) -> bool:
    """No open session, and no engine and no sampler snapshot on any rank, as reported by the ranks (every 2 s)."""
    metrics = scrape(server.base_url)
    return (metrics[("tinker_sessions", ())] == 0 and engines_bytes(server.base_url) == [0.0, 0.0]
            and engines_bytes(server.base_url, "snapshots") == [0.0, 0.0])


def drop_clients(server, count: int, rank: int) -> tuple[subprocess.Popen, list[str]]:
    """A client process with ``count`` LoRA training clients, one step taken on each, then frozen (SIGSTOP)."""
    client = subprocess.Popen([sys.executable, str(Path(__file__).with_name("session_client.py")), server.base_url,
                               API_KEY, str(count), str(rank)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    line = client.stdout.readline()
    assert line.startswith("READY"), f"the client did not get ready: {line!r}"
    client.send_signal(signal.SIGSTOP)
    import json

    return client, json.loads(line.split(" ", 1)[1])


def test_a_dropped_clients_sessions_are_closed_and_their_memory_returns(service_server) -> None:
    server = service_server
    # Warm up: the first LoRA client builds the shared base model and imports what engines need.
    client, _ = drop_clients(server, 1, 8)
    wait_until(lambda: settled(server), 120, "the warm-up client's session closed")
    client.kill()
    client.wait()
    time.sleep(3)  # one more memory report after the unload
    baseline = ranks_rss(server)

    client, model_ids = drop_clients(server, 6, 64)
    time.sleep(3)
    loaded, peak = engines_bytes(server.base_url), ranks_rss(server)
    assert min(loaded) > 5e6, f"six rank-64 LoRA engines on each rank: {loaded}"
    snapshots = engines_bytes(server.base_url, "snapshots")
    assert min(snapshots) > 0, f"six LoRA snapshots on each rank: {snapshots}"
    # A request held back behind a seq_id that never comes: pending until the session closes.
    held = post(server.base_url, "optim_step", {"model_id": model_ids[0], "seq_id": 50, "adam_params": {}})
    assert poll_once(server.base_url, held["request_id"]).get("type") == "try_again"

    started = time.monotonic()
    wait_until(lambda: settled(server), SESSION_TIMEOUT_S + 60, "the dropped client's session closed and unloaded")
    closed_after = time.monotonic() - started
    failed = result(server.base_url, held["request_id"])
    assert failed["category"] == "user" and "was closed: no heartbeat for" in failed["error"]
    assert "--session-timeout-s" in failed["error"]
    time.sleep(3)
    after = ranks_rss(server)
    grown, left = peak - baseline, after - baseline
    print(f"RSS of the server: baseline {baseline / 2**20:.0f} MiB, with 6 dropped clients +{grown / 2**20:.1f} MiB, "
          f"{closed_after:.1f} s after the drop +{left / 2**20:.1f} MiB; engines per rank {loaded} -> 0, "
          f"sampler snapshots {snapshots} -> 0")
    assert grown > 8 * 2**20, "the clients' engines should show in the processes' memory"
    assert left < 0.5 * grown, f"the memory did not return: +{grown} bytes with the clients, +{left} after"

    # The client comes back: every call on its closed session raises, saying why.
    client.send_signal(signal.SIGCONT)
    out, _ = client.communicate("go\n", timeout=300)
    raised = [line for line in out.splitlines() if line.startswith(("RAISED", "OK"))]
    assert len(raised) == 6 and all(line.startswith("RAISED RequestFailedError") for line in raised), out
    assert all("was closed: no heartbeat for" in line for line in raised), raised[0]
    status = post(server.base_url, "session_heartbeat", {"session_id": model_ids[0].split(":")[0]})
    assert status["http_status"] == 410


def test_two_clients_interleave_and_queue_state_tells_the_truth(service_server) -> None:
    """A sampler queues 96 long completions, then a trainer steps: the trainer is served between the sampler's
    jobs (round-robin), not after its whole queue."""
    server = service_server
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    trainer = service.create_lora_training_client(BASE, rank=8).result()
    rng = np.random.default_rng(0)
    data = to_sdk(random_data(rng, 8))
    adam = types.AdamParams(learning_rate=1e-3)
    trainer.forward_backward(data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
    trainer.optim_step(adam).result(timeout=RESULT_TIMEOUT_S)

    session = post(server.base_url, "create_session", {})["session_id"]
    sampler = post(server.base_url, "create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                                "base_model": BASE})["sampling_session_id"]
    requests = 96
    samples = [post(server.base_url, "asample", {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(b"Tell me a long story: ")}]},
        "num_samples": 1, "sampling_session_id": sampler, "seq_id": i + 1,
        "sampling_params": {"max_tokens": 200, "stop": [], "seed": i}})["request_id"] for i in range(requests)]

    started = time.monotonic()
    forward_backward = trainer.forward_backward(data, "cross_entropy")
    step = trainer.optim_step(adam)
    forward_backward.result(timeout=RESULT_TIMEOUT_S)
    step.result(timeout=RESULT_TIMEOUT_S)
    step_s = time.monotonic() - started
    metrics = scrape(server.base_url)
    waiting = metrics.get(("tinker_queue_depth", (("session", session), )), 0)
    sampled = metrics.get(("tinker_requests_total", (("kind", "sample"), ("status", "ok"))), 0)
    print(f"trainer step {step_s:.2f} s beside the sampler; {waiting:.0f} of its {requests} requests still queued, "
          f"{sampled:.0f} done")
    assert waiting > 0 and sampled < requests, "the trainer waited for the sampler's whole queue"

    # A sampler request still queued behind another session's work says so; the server is busy, not broken.
    last = poll_once(server.base_url, samples[-1])
    if last.get("type") == "try_again":
        assert last["queue_state"] in ("active", "paused_capacity") and last["queue_state_reason"]
    for request_id in samples:
        assert "sequences" in result(server.base_url, request_id), request_id
    assert scrape(server.base_url)[("tinker_tokens_total", (("kind", "sample"), ))] >= requests * 200
    service.close("success").result(timeout=30)
