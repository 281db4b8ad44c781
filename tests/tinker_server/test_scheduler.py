"""The scheduler on its own: seq_id order per model, retries, rejected slots, long polls."""

from __future__ import annotations

import threading
import time

import pytest

from deepspeed_tinker.scheduler import FutureStore, Scheduler

pytestmark = pytest.mark.pr("zero-0-1")


def drain(scheduler: Scheduler) -> list[tuple[str, str, object]]:
    jobs = []
    while (job := scheduler.next_job(timeout=0)) is not None:
        jobs.append((job.kind, job.model_id, job.payload))
    return jobs


def test_jobs_run_in_seq_order_whatever_the_arrival_order() -> None:
    scheduler = Scheduler(FutureStore())
    scheduler.open_model("m")
    scheduler.submit_sequenced("m", 3, "optim_step", "c")
    scheduler.submit_sequenced("m", 2, "forward_backward", "b")
    assert drain(scheduler) == [], "nothing may run while seq 1 is missing"
    scheduler.submit_sequenced("m", 1, "forward_backward", "a")
    assert [p for _, _, p in drain(scheduler)] == ["a", "b", "c"]


def test_models_are_ordered_independently() -> None:
    scheduler = Scheduler(FutureStore())
    scheduler.open_model("m")
    scheduler.open_model("n")
    scheduler.submit_sequenced("m", 2, "forward_backward", "m2")
    scheduler.submit_sequenced("n", 1, "forward_backward", "n1")
    scheduler.submit_sequenced("m", 1, "forward_backward", "m1")
    assert [p for _, _, p in drain(scheduler)] == ["n1", "m1", "m2"]


def test_a_retried_seq_id_gets_the_first_future_and_runs_once() -> None:
    scheduler = Scheduler(FutureStore())
    scheduler.open_model("m")
    first = scheduler.submit_sequenced("m", 1, "forward_backward", "a")
    again = scheduler.submit_sequenced("m", 1, "forward_backward", "a")
    assert first == again
    assert len(drain(scheduler)) == 1
    assert scheduler.submit_sequenced("m", 1, "forward_backward", "a") == first, "a retry after it ran, too"


def test_a_rejected_request_fails_at_once_and_fills_its_slot() -> None:
    futures = FutureStore()
    scheduler = Scheduler(futures)
    scheduler.open_model("m")
    bad = scheduler.submit_sequenced("m", 1, "forward_backward", None, rejection="token id 999 outside")
    assert futures.wait(bad, 0).status == "error"
    assert futures.wait(bad, 0).category == "user"
    scheduler.submit_sequenced("m", 2, "optim_step", "step")
    assert drain(scheduler) == [("optim_step", "m", "step")], "the rejected request never reaches a rank"


def test_unknown_model_and_replayed_seq_are_refused() -> None:
    scheduler = Scheduler(FutureStore())
    with pytest.raises(KeyError):
        scheduler.submit_sequenced("nope", 1, "forward_backward")
    scheduler.open_model("m", first_seq=5)
    with pytest.raises(ValueError):
        scheduler.submit_sequenced("m", 4, "forward_backward")


def test_long_poll_returns_when_the_result_arrives() -> None:
    futures = FutureStore()
    future = futures.create()
    threading.Timer(0.1, futures.resolve, args=(future.request_id, 42)).start()
    start = time.monotonic()
    done = futures.wait(future.request_id, timeout=5)
    assert done.status == "ok" and done.result == 42
    assert time.monotonic() - start < 2
    assert futures.wait("req-unknown", 0) is None
    pending = futures.create()
    assert futures.wait(pending.request_id, timeout=0.05).status == "pending"


def test_stop_wakes_the_executor() -> None:
    scheduler = Scheduler(FutureStore())
    threading.Timer(0.1, scheduler.stop).start()
    start = time.monotonic()
    assert scheduler.next_job(timeout=5) is None
    assert time.monotonic() - start < 2
