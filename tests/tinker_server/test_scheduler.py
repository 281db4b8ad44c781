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
    future = futures.create("s")
    threading.Timer(0.1, futures.resolve, args=(future.request_id, 42)).start()
    start = time.monotonic()
    done = futures.wait(future.request_id, timeout=5)
    assert done.status == "ok" and done.result == 42
    assert time.monotonic() - start < 2
    assert futures.wait("req-unknown", 0) is None
    pending = futures.create("s")
    assert futures.wait(pending.request_id, timeout=0.05).status == "pending"


def test_stop_wakes_the_executor() -> None:
    scheduler = Scheduler(FutureStore())
    threading.Timer(0.1, scheduler.stop).start()
    start = time.monotonic()
    assert scheduler.next_job(timeout=5) is None
    assert time.monotonic() - start < 2


def test_sessions_take_turns_and_keep_their_own_order() -> None:
    """Jobs of equal cost: round-robin across sessions; a session with a long queue delays another by one job, not
    by its queue."""
    scheduler = Scheduler(FutureStore(), clock=lambda: 0.0)
    scheduler.open_model("a:train:0", session="a")
    scheduler.open_model("b:train:0", session="b")
    for i in range(1, 6):
        scheduler.submit("sample", "a:sample:0", f"a{i}", session="a")
    scheduler.submit_sequenced("b:train:0", 2, "optim_step", "b2")
    scheduler.submit_sequenced("b:train:0", 1, "forward_backward", "b1")
    scheduler.submit_sequenced("a:train:0", 1, "forward_backward", "a6")
    assert [p for _, _, p in drain(scheduler)] == ["a1", "b1", "a2", "b2", "a3", "a4", "a5", "a6"]


def test_the_fifo_order_would_starve_the_second_session() -> None:
    """What the round-robin changes: before, b's request ran after all of a's queue."""
    scheduler = Scheduler(FutureStore(), clock=lambda: 0.0)
    for i in range(4):
        scheduler.submit("sample", "a:sample:0", f"a{i}", session="a")
    scheduler.submit("forward_backward", "b:train:0", "b", session="b")
    order = [p for _, _, p in drain(scheduler)]
    assert order.index("b") == 1, order


def test_sessions_share_the_ranks_time_not_turns() -> None:
    """A session whose jobs take 10 s (long sampling) against one whose jobs take 1 s (training steps): after each
    long job the short session runs until it has used as much time; neither starves."""
    now = [0.0]
    cost = {"a": 10.0, "b": 1.0}
    scheduler = Scheduler(FutureStore(), clock=lambda: now[0])
    for i in range(3):
        scheduler.submit("sample", "a:sample:0", f"a{i}", session="a")
    for i in range(25):
        scheduler.submit("forward_backward", "b:train:0", f"b{i}", session="b")
    order = []
    while (job := scheduler.next_job(timeout=0)) is not None:
        order.append(job.payload)
        now[0] += cost[job.session]
    assert order[:12] == ["a0", *[f"b{i}" for i in range(10)], "a1"], order
    assert order.index("a2") == 22, "a's third job after b has used as much time as a's first two"


def test_an_idle_session_does_not_bank_time() -> None:
    """A session that had no work while another ran starts level with it, not with a credit of the time it idled."""
    now = [0.0]
    scheduler = Scheduler(FutureStore(), clock=lambda: now[0])
    for i in range(20):
        scheduler.submit("forward_backward", "a:train:0", f"a{i}", session="a")
    for _ in range(10):
        scheduler.next_job(timeout=0)
        now[0] += 1.0
    for i in range(3):
        scheduler.submit("forward_backward", "b:train:0", f"b{i}", session="b")
    order = []
    while (job := scheduler.next_job(timeout=0)) is not None:
        order.append(job.payload)
        now[0] += 1.0
    assert order[:6] == ["b0", "a10", "b1", "a11", "b2", "a12"], order  # not b0, b1, b2 in a row


def test_a_sampling_batch_takes_its_session_then_the_other_sessions_heads() -> None:
    scheduler = Scheduler(FutureStore(), clock=lambda: 0.0)
    scheduler.submit("sample", "a:sample:0", "a1", session="a")
    scheduler.submit("forward_backward", "b:train:0", "b1", session="b")
    scheduler.submit("sample", "c:sample:0", "c1", session="c")
    scheduler.submit("sample", "a:sample:0", "a2", session="a")
    scheduler.submit("create", "a:train:1", "a3", session="a")
    scheduler.submit("sample", "a:sample:0", "a4", session="a")
    first = scheduler.next_job(timeout=0)
    assert first.payload == "a1"
    assert [j.payload for j in scheduler.take_consecutive("sample", 10)] == ["a2", "c1"], \
        "a's order stops the batch at its create; b's head is not a sample"
    assert [p for _, _, p in drain(scheduler)] == ["b1", "a3", "a4"]


def test_positions_and_depths_say_where_requests_wait() -> None:
    futures = FutureStore()
    scheduler = Scheduler(futures, clock=lambda: 0.0)
    scheduler.open_model("b:train:0", session="b")
    a = [scheduler.submit("sample", "a:sample:0", i, session="a") for i in range(3)]
    held = scheduler.submit_sequenced("b:train:0", 2, "optim_step")
    b1 = scheduler.submit_sequenced("b:train:0", 1, "forward_backward")
    assert scheduler.depths() == {"a": 3, "b": 2}
    assert scheduler.position(a[0]).state == "queued" and scheduler.position(a[0]).others == 0
    position = scheduler.position(b1)  # a's first job runs before it
    assert (position.own, position.others, position.sessions) == (0, 1, 1)
    assert scheduler.position(a[2]).others == 2, "b's two jobs come before a's third"
    assert scheduler.position(held).state == "queued"
    scheduler.submit_sequenced("b:train:0", 4, "forward_backward")
    assert scheduler.position(scheduler.submit_sequenced("b:train:0", 4, "x")).state == "held"
    job = scheduler.next_job(timeout=0)
    assert scheduler.position(job.request_id) is None, "running"
    assert futures.wait(job.request_id, 0).started is not None


def test_dropping_a_session_fails_its_waiting_jobs_only() -> None:
    futures = FutureStore()
    scheduler = Scheduler(futures)
    scheduler.open_model("a:train:0", session="a")
    queued = scheduler.submit_sequenced("a:train:0", 1, "forward_backward", "a1")
    held = scheduler.submit_sequenced("a:train:0", 3, "optim_step", "a3")
    other = scheduler.submit("sample", "b:sample:0", "b1", session="b")
    assert scheduler.drop_session("a", "session a was closed: no heartbeat") == ["a:train:0"]
    for request_id in (queued, held):
        future = futures.wait(request_id, 0)
        assert (future.status, future.category) == ("error", "user")
        assert future.error == "session a was closed: no heartbeat"
    assert not scheduler.has_model("a:train:0")
    assert futures.wait(other, 0).status == "pending"
    assert [p for _, _, p in drain(scheduler)] == ["b1"]
