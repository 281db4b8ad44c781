"""A rank that dies ends the SDK's calls in an error it raises, not in a hang; then the server exits non-zero.

Real 2-rank servers, the official SDK, a rank killed with SIGKILL: while the server is idle (the next call must
raise), and in the middle of a sampling job (that job's future must fail). The SDK retries connection errors and
5xx answers for hours; it raises only for a failed future with a category, which is what the server must answer.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from tinker_sdk_helpers import require

tinker = require("tinker")
from tinker import types  # noqa: E402
from tinker_sdk_helpers import API_KEY, log_tail, random_data, start_server, to_sdk  # noqa: E402

from deepspeed_tinker.faults import EXIT_RANK_FAILED  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")

#: The issue's bound on "the next call raises" is 2 minutes; the server does it in about a second.
RAISE_WITHIN_S = 30
DRAIN_S = 10


def rank_process(server, rank: int) -> psutil.Process:
    """Rank ``rank`` of a server started by ``ServerProcess`` (a child of its launcher)."""
    for child in psutil.Process(server.process.pid).children():
        if child.environ().get("RANK") == str(rank):
            return child
    raise AssertionError(f"no rank {rank} under the launcher")


def assert_server_error(failed: pytest.ExceptionInfo, rank: int) -> None:
    assert failed.value.category == types.RequestErrorCategory.Server, failed.value
    assert f"rank {rank}" in str(failed.value), failed.value


def assert_exits_with_fault(server) -> None:
    """Past its drain window the server (launcher and ranks) exits with ``EXIT_RANK_FAILED``."""
    code = server.process.wait(timeout=DRAIN_S + 60)
    assert code == EXIT_RANK_FAILED, f"exit {code}\n{log_tail(server)}"
    assert "FAULT: rank 1 died" in server.log_path.read_text(), log_tail(server)


def test_a_rank_killed_while_idle_makes_the_next_call_raise(tmp_path: Path) -> None:
    server = start_server(tmp_path, 1, extra_args=("--fault-drain-s", str(DRAIN_S)))
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        training = service.create_lora_training_client(base_model="tiny-llama-byte", rank=4,
                                                       seed=1).result(timeout=120)
        rng = np.random.default_rng(3)
        training.forward_backward(to_sdk(random_data(rng, 2)), "cross_entropy").result(timeout=120)

        rank_process(server, 1).kill()
        killed = time.monotonic()
        with pytest.raises(tinker.RequestFailedError) as failed:
            training.forward_backward(to_sdk(random_data(rng, 2)), "cross_entropy").result(timeout=110)
        print(f"the next call raised {time.monotonic() - killed:.2f} s after the kill")
        assert time.monotonic() - killed < RAISE_WITHIN_S
        assert_server_error(failed, 1)
        # A load balancer or supervisor sees the fault too.
        health = httpx.get(f"{server.base_url}/api/v1/healthz", headers={"X-API-Key": API_KEY}, timeout=30)
        assert health.status_code == 503 and "rank 1" in health.json()["error"], health.text
        # A new client in the drain window: answered (no connection error to retry), and its work fails the same way.
        other = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        with pytest.raises(tinker.RequestFailedError) as failed:
            other.create_lora_training_client(base_model="tiny-llama-byte", rank=4).result(timeout=60)
        assert_server_error(failed, 1)
        assert_exits_with_fault(server)
    finally:
        server.stop()


def test_a_rank_killed_mid_job_fails_that_job(tmp_path: Path) -> None:
    server = start_server(tmp_path, 1, extra_args=("--fault-drain-s", str(DRAIN_S)))
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        sampler = service.create_sampling_client(base_model="small-llama-byte").result()
        follower = rank_process(server, 1)
        busy_before = sum(follower.cpu_times()[:2])
        # 64 samples to the end of the context: far longer than the kill takes to land.
        job = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), num_samples=64,
                             sampling_params=types.SamplingParams(max_tokens=500, stop=[], seed=5))
        deadline = time.monotonic() + 120
        while sum(follower.cpu_times()[:2]) - busy_before < 1.0:  # rank 1 is computing its share: mid-job
            assert time.monotonic() < deadline, "rank 1 never started the sampling job"
            time.sleep(0.1)
        follower.kill()
        killed = time.monotonic()
        with pytest.raises(tinker.RequestFailedError) as failed:
            job.result(timeout=110)
        print(f"the job in flight raised {time.monotonic() - killed:.2f} s after the kill")
        assert time.monotonic() - killed < RAISE_WITHIN_S
        assert_server_error(failed, 1)
        assert_exits_with_fault(server)
    finally:
        server.stop()
