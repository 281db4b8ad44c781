"""The bounded future store: a full session or store means 429 for new work, never a dropped pending future; one
session's flood leaves the others served; results kept for their documented time (no ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepspeed_tinker.scheduler import FutureStore, FutureStoreFull, Scheduler

pytestmark = pytest.mark.pr("zero-0-1")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_full_store_refuses_new_work_and_keeps_every_pending_future() -> None:
    clock = Clock()
    futures = FutureStore(max_futures=4, finished_ttl_s=60, max_per_session=4, clock=clock)
    pending = [futures.create("s") for _ in range(2)]
    finished = [futures.create("t") for _ in range(2)]
    for future in finished:
        futures.resolve(future.request_id, {"ok": True})
    with pytest.raises(FutureStoreFull, match="--max-futures"):
        futures.create("u")
    clock.now += 59
    with pytest.raises(FutureStoreFull):
        futures.create("u")
    assert all(futures.wait(f.request_id, 0).result == {"ok": True} for f in finished), "kept for their TTL"
    clock.now += 2  # the finished results expire; the pending futures never do
    replacement = futures.create("u")
    assert futures.wait(finished[0].request_id, 0) is None
    assert all(futures.wait(f.request_id, 0).status == "pending" for f in pending)
    futures.create("u")
    with pytest.raises(FutureStoreFull):
        futures.create("u")
    clock.now += 10_000
    with pytest.raises(FutureStoreFull):  # four pending futures: full for as long as they are pending
        futures.create("u")
    futures.resolve(replacement.request_id, 1)
    assert futures.wait(replacement.request_id, 0).result == 1
    assert futures.create("u", internal=True), "the server's own bookkeeping is never refused"
    assert futures.counts() == (4, 1)


def test_one_sessions_flood_is_refused_and_the_other_sessions_go_on() -> None:
    clock = Clock()
    futures = FutureStore(max_futures=100, finished_ttl_s=3600, clock=clock)
    assert futures.max_per_session == 25, "by default a session holds at most a quarter of the store"
    flood = [futures.create("flood") for _ in range(25)]
    for future in flood:
        futures.fail(future.request_id, "bad request", "user")
    with pytest.raises(FutureStoreFull, match="session flood holds 25 requests.*--max-futures-per-session"):
        futures.create("flood")
    for session in ("a", "b", "c"):
        assert [futures.create(session) for _ in range(25)], f"session {session} is served in full"
    with pytest.raises(FutureStoreFull, match="the server is full"):
        futures.create("d")
    assert futures.create("flood", internal=True), "work that releases accepted work is never refused"


def test_a_retrieved_result_is_freed_after_the_grace_and_an_unretrieved_one_after_its_ttl() -> None:
    clock = Clock()
    futures = FutureStore(max_futures=10, finished_ttl_s=3600, max_per_session=2, retrieved_grace_s=60,
                          clock=clock)
    read, unread = futures.create("s"), futures.create("s")
    futures.resolve(read.request_id, 1)
    futures.resolve(unread.request_id, 2)
    futures.retrieved(read.request_id)
    clock.now += 30
    futures.retrieved(read.request_id)  # a retry of a lost response: the grace runs from the last retrieval
    clock.now += 59
    assert futures.wait(read.request_id, 0).result == 1, "kept for a retry"
    with pytest.raises(FutureStoreFull, match="session s holds 2"):
        futures.create("s")
    clock.now += 1
    assert futures.create("s"), "the retrieved result is freed after the grace: room again"
    assert futures.wait(read.request_id, 0) is None
    assert futures.wait(unread.request_id, 0).result == 2, "a result nobody retrieved waits for its TTL"
    clock.now += 3600
    futures.create("t")
    assert futures.wait(unread.request_id, 0) is None


def test_only_the_seq_id_held_work_waits_for_passes_a_full_session() -> None:
    """The exemption is for the request that releases accepted work, not for every seq_id below a far-off one: a
    client cannot queue without bound behind seq_id 1000."""
    futures = FutureStore(max_futures=100, max_per_session=3)
    scheduler = Scheduler(futures)
    scheduler.open_model("m", session="s")
    scheduler.submit_sequenced("m", 1000, "optim_step", "far")
    scheduler.submit_sequenced("m", 3, "optim_step", "c")
    scheduler.submit_sequenced("m", 4, "optim_step", "d")
    with pytest.raises(FutureStoreFull, match="--max-futures-per-session"):
        scheduler.submit_sequenced("m", 5, "optim_step", "e")
    with pytest.raises(FutureStoreFull):
        scheduler.submit_sequenced("m", 2, "optim_step", "b")  # not yet the one the others wait for
    assert scheduler.submit_sequenced("m", 1, "optim_step", "a"), "seq 1 releases held work: let in"
    assert [scheduler.next_job(timeout=0).payload for _ in range(1)] == ["a"]


def test_a_finished_sessions_held_back_requests_fail_instead_of_waiting_forever() -> None:
    futures = FutureStore()
    scheduler = Scheduler(futures)
    scheduler.open_model("m", session="s")
    queued = scheduler.submit_sequenced("m", 1, "optim_step", "a")
    held = scheduler.submit_sequenced("m", 3, "optim_step", "c")  # waits for seq 2, which never comes
    scheduler.close_model("m", "session s was finished")
    assert futures.wait(held, 0).status == "error" and futures.wait(held, 0).error == "session s was finished"
    assert futures.wait(queued, 0).status == "pending", "released work still runs"
    assert scheduler.next_job(timeout=0).request_id == queued


def test_a_refused_request_leaves_no_trace_and_the_slot_that_releases_work_is_never_refused(tmp_path: Path) -> None:
    from tinker_sdk_helpers import require

    require("fastapi")
    from http_in_process import handle

    from deepspeed_tinker.api import ApiSettings, TinkerApi

    clock = Clock()
    futures = FutureStore(max_futures=100, finished_ttl_s=60, max_per_session=3, clock=clock)
    api = TinkerApi(Scheduler(futures), ApiSettings(tmp_path, long_poll_s=0.05))
    key = {"x-api-key": "tml-test"}

    def post(route: str, body: dict, **headers: str):
        reply = handle(api, "POST", f"/api/v1/{route}", {**key, **headers}, json.dumps(body).encode())
        return reply.status, json.loads(reply.body)

    session = post("create_session", {})[1]["session_id"]
    model_id = post("create_model", {"session_id": session, "model_seq_id": 0, "base_model": "tiny-llama-byte",
                                     "lora_config": {"rank": 4}})[1]["model_id"]
    adam = {"adam_params": {"learning_rate": 1e-3}}
    held = post("optim_step", {"model_id": model_id, "seq_id": 2, **adam})[1]["request_id"]
    post("optim_step", {"model_id": model_id, "seq_id": "x", **adam})  # a failed future: the session's third
    status, reply = post("optim_step", {"model_id": model_id, "seq_id": 3, **adam}, **{"x-idempotency-key": "k"})
    assert status == 429 and "--max-futures-per-session" in reply["error"]
    assert post("create_model", {"session_id": session, "model_seq_id": 1, "base_model": "tiny-llama-byte"})[0] == 429
    assert not api.scheduler.has_model(f"{session}:train:1"), "a refused create registers nothing"
    status, reply = post("optim_step", {"model_id": model_id, "seq_id": 1, **adam})
    assert status == 200, "seq 1 releases the accepted seq 2: never refused for room"
    assert futures.wait(held, 0).status == "pending"
    job = api.scheduler.next_job(timeout=0)  # the create runs
    futures.resolve(job.request_id, {})
    clock.now += 61  # and the finished results expire: room again
    status, reply = post("optim_step", {"model_id": model_id, "seq_id": 3, **adam}, **{"x-idempotency-key": "k"})
    assert status == 200, "the retry is not answered from the idempotency cache with the 429"
    assert [api.scheduler.next_job(timeout=0).kind for _ in range(3)] == ["optim_step"] * 3


def test_fail_all_fails_every_pending_future_and_every_new_one() -> None:
    """After a fault (``faults.FaultDrain``): pending futures fail, finished ones keep their result, and a future
    created afterwards is born failed, so a request that arrives during the drain gets the error, not a hang."""
    futures = FutureStore()
    done, waiting = futures.create("s"), futures.create("s")
    futures.resolve(done.request_id, {"ok": True})
    assert futures.fail_all("rank 1 died", "server") == 1
    assert (futures.wait(done.request_id, 0).status, futures.wait(done.request_id, 0).result) == ("ok", {"ok": True})
    for future in (futures.wait(waiting.request_id, 0), futures.create("s")):
        assert (future.status, future.error, future.category) == ("error", "rank 1 died", "server")
    futures.resolve(waiting.request_id, {"late": True})  # a job that finishes after the fault changes nothing
    assert futures.wait(waiting.request_id, 0).status == "error"
    assert futures.counts() == (0, 3)


def test_a_finished_job_is_recorded_before_its_future_resolves() -> None:
    """What makes ``save_state`` durable before it is acknowledged: rank 0 records a finished job (the checkpoint
    into the store) while its future is still pending, and a record that fails fails the future as a server error
    instead of acknowledging a checkpoint the store does not have."""
    from tinker_sdk_helpers import require

    require("fastapi")  # the server module serves HTTP too
    from deepspeed_tinker.jobs import CheckpointRecord, JobKind, SaveWeights, WeightsMeta
    from deepspeed_tinker.server import _record_and_resolve

    futures = FutureStore()
    scheduler = Scheduler(futures)

    class Recorder:
        def __init__(self, fails: bool) -> None:
            self.fails, self.seen = fails, []

        def record_checkpoint(self, checkpoint: CheckpointRecord) -> None:
            if self.fails:
                raise OSError("disk full")
            self.seen.append((checkpoint.checkpoint_id, futures.wait(request_id, 0).status))

    def save(name: str) -> str:
        checkpoint = CheckpointRecord("m", f"weights/{name}", f"/ckpt/{name}", None, None)
        return scheduler.submit(JobKind.SAVE_WEIGHTS, "m", SaveWeights(checkpoint.dir, f"tinker://m/weights/{name}",
                                                                       False, WeightsMeta("b", None), checkpoint),
                                session="s")

    request_id = save("1")
    recorder = Recorder(fails=False)
    _record_and_resolve(scheduler.next_job(timeout=0), {"path": "tinker://m/weights/1"}, futures, recorder)
    assert recorder.seen == [("weights/1", "pending")]
    saved = futures.wait(request_id, 0)
    assert saved.status == "ok" and saved.result == {"path": "tinker://m/weights/1"}

    request_id = save("2")
    _record_and_resolve(scheduler.next_job(timeout=0), {"path": "tinker://m/weights/2"}, futures, Recorder(True))
    future = futures.wait(request_id, 0)
    assert (future.status, future.category, future.result) == ("error", "server", None)
    assert "could not record the result: OSError: disk full" in future.error
