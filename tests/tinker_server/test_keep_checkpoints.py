"""``--keep-checkpoints K``: each training run keeps its K newest training and K newest sampler checkpoints.

The store's rule on its own (no ranks), then a 2-rank server through the SDK: older checkpoints disappear from the
RestClient's listings, from disk and from loads after each save, and a restart with a smaller K prunes at start-up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tinker_sdk_helpers import API_KEY, RESULT_TIMEOUT_S, require, start_server, stop_server, unmanaged_stage_supported

tinker = require("tinker")
from tinker import types  # noqa: E402

from deepspeed_tinker.api import checkpoint_dir, parse_tinker_path  # noqa: E402
from deepspeed_tinker.checkpoint_store import CheckpointStore  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_the_store_keeps_the_k_newest_of_each_type_per_run(tmp_path: Path) -> None:
    clock = Clock()
    store = CheckpointStore(tmp_path, clock)
    dirs = {}
    for i in range(4):  # run r1: weights/w0..w3, sampler_weights/s0..s3, external_weights/e0..e3; r2: weights/w0
        for run, segment in (("r1", "weights"), ("r1", "sampler_weights"), ("r1", "external_weights"),
                             ("r2", "weights")):
            if run == "r2" and i > 0:
                continue
            directory = tmp_path / run / segment / f"{segment[0]}{i}"
            directory.mkdir(parents=True)
            dirs[f"{run}/{segment}/{segment[0]}{i}"] = directory
            store.add_checkpoint(run, f"{segment}/{segment[0]}{i}", directory, 1)
        clock.now += 1
    with pytest.raises(ValueError):
        store.prune(0)

    pruned = store.prune(2, "r1")
    assert sorted(pruned) == ["tinker://r1/sampler_weights/s0", "tinker://r1/sampler_weights/s1",
                              "tinker://r1/weights/w0", "tinker://r1/weights/w1"]
    assert [row.checkpoint_id for row in store.checkpoints("r1")] == [
        "external_weights/e3", "sampler_weights/s3", "weights/w3", "external_weights/e2", "sampler_weights/s2",
        "weights/w2", "external_weights/e1", "external_weights/e0"], "exports are left alone"
    assert not dirs["r1/weights/w1"].exists() and dirs["r1/weights/w2"].is_dir()
    assert store.prune(2) == [], "another run's single checkpoint is within K"

    store.set_ttl("r1", "weights/w3", 1)
    clock.now += 2  # w3 expired: the newest live one is w2, and it is kept
    assert store.prune(1) == ["tinker://r1/sampler_weights/s2"]
    assert store.checkpoint("r1", "weights/w2") is not None and store.checkpoint("r2", "weights/w0") is not None
    assert store.reap() == ["tinker://r1/weights/w3"]


def test_a_server_keeps_the_k_newest_checkpoints_and_prunes_at_start_up(tmp_path: Path) -> None:
    stage = next((s for s in (1, 0, 2, 3) if unmanaged_stage_supported(s)), None)
    if stage is None:
        pytest.skip("this DeepSpeed supports no ZeRO stage in unmanaged mode")
    checkpoints = tmp_path / "ckpt"

    def on_disk(path: str) -> bool:
        run, name = parse_tinker_path(path, ("weights", "sampler_weights"))
        return checkpoint_dir(checkpoints, run, name, path.split("/")[-2]).is_dir()

    server = start_server(tmp_path / "first", stage, checkpoints, extra_args=("--keep-checkpoints", "2"))
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        rest = tinker.RestClient(base_url=server.base_url, api_key=API_KEY)
        training = service.create_lora_training_client(base_model="tiny-llama-byte", rank=4, seed=1).result()
        other = service.create_lora_training_client(base_model="tiny-llama-byte", rank=4, seed=2).result()
        other_path = other.save_state("only").result(timeout=RESULT_TIMEOUT_S).path
        datum = types.Datum(model_input=types.ModelInput.from_ints(list(b"keep the newest")),
                            loss_fn_inputs={"target_tokens": list(b"eep the newest!"), "weights": [1.0] * 15})
        states, samplers = [], []
        for i in range(3):
            training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=1e-2))
            states.append(training.save_state(f"step{i}").result(timeout=RESULT_TIMEOUT_S).path)
            samplers.append(training.save_weights_for_sampler(f"step{i}").result(timeout=RESULT_TIMEOUT_S).path)

        listed = {c.tinker_path for c in rest.list_checkpoints(training.model_id).result(timeout=30).checkpoints}
        assert listed == {*states[1:], *samplers[1:]}
        assert not on_disk(states[0]) and not on_disk(samplers[0]) and all(map(on_disk, states[1:] + samplers[1:]))
        assert [c.tinker_path for c in rest.list_checkpoints(other.model_id).result(timeout=30).checkpoints] \
            == [other_path], "another run's checkpoints are its own"
        with pytest.raises(tinker.RequestFailedError):
            service.create_training_client_from_state(states[0]).result()
        service.close("success").result(timeout=30)
    finally:
        stop_server(server)

    server = start_server(tmp_path / "second", stage, checkpoints, extra_args=("--keep-checkpoints", "1"))
    try:
        rest = tinker.RestClient(base_url=server.base_url, api_key=API_KEY)
        listed = {c.tinker_path for c in rest.list_checkpoints(training.model_id).result(timeout=30).checkpoints}
        assert listed == {states[2], samplers[2]}, "pruned to the newest at start-up"
        assert not on_disk(states[1]) and not on_disk(samplers[1]) and on_disk(states[2])
        service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        assert service.create_training_client_from_state(states[2]).result().get_info().model_data is not None
        service.close("success").result(timeout=30)
    finally:
        stop_server(server)
