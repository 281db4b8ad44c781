"""save_weights -> stop (or kill) -> a new server loads the checkpoint -> the next step is identical.

Killed: the whole server (launcher and ranks) gets SIGKILL the moment the SDK has the last ``save_state``'s
acknowledgement; that checkpoint must be in the store and load, since the ack promised it exists.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tinker_sdk_helpers import require

tinker = require("tinker")
from tinker import types  # noqa: E402
from tinker_sdk_helpers import (  # noqa: E402
    API_KEY,
    RESULT_TIMEOUT_S,
    adam,
    random_data,
    saved_weights,
    start_server,
    stop_server,
    to_sdk,
    unmanaged_stage_supported,
)

from deepspeed_tinker.api import parse_tinker_path  # noqa: E402
from deepspeed_tinker.checkpoint_store import CheckpointStore  # noqa: E402
from local_ranks.procs import kill_tree  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")


def train_step(training, batches: list, params: dict[str, float]) -> dict[str, float]:
    futures = [training.forward_backward(to_sdk(batch), "cross_entropy") for batch in batches]
    optim = training.optim_step(types.AdamParams(**params))
    for future in futures:
        future.result(timeout=RESULT_TIMEOUT_S)
    return optim.result(timeout=RESULT_TIMEOUT_S).metrics


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_restarted_server_continues_identically(tmp_path: Path, how: str) -> None:
    stages = [s for s in range(4) if unmanaged_stage_supported(s)]
    if not stages:
        pytest.skip("this DeepSpeed supports no ZeRO stage in unmanaged mode")
    stage, checkpoints = stages[-1], tmp_path / "ckpt"  # the most sharded stage available
    rng = np.random.default_rng(21)
    steps = [([random_data(rng, 2), random_data(rng, 3)], adam(learning_rate=1e-2)),
             ([random_data(rng, 4)], adam(learning_rate=2e-2, weight_decay=0.05)),
             ([random_data(rng, 1), random_data(rng, 2), random_data(rng, 2)], adam(learning_rate=1e-2, beta1=0.5))]

    first = start_server(tmp_path / "first", stage, checkpoints)
    try:
        service = tinker.ServiceClient(base_url=first.base_url, api_key=API_KEY)
        training = service.create_lora_training_client(base_model="tiny-llama-byte", rank=4,
                                                       seed=9).result(timeout=120)
        for batches, params in steps[:2]:
            train_step(training, batches, params)
        middle = training.save_state("middle").result(timeout=RESULT_TIMEOUT_S)
        uninterrupted = train_step(training, *steps[2])
        after = training.save_state("after").result(timeout=RESULT_TIMEOUT_S)
        if how == "killed":
            kill_tree(first.process.pid)  # right after the ack: nothing of the server runs on
        else:
            service.close("success").result(timeout=30)
    finally:
        if how == "killed":
            first.stop()
        else:
            stop_server(first)
    if how == "killed":  # the acknowledged checkpoint is recorded and complete
        run_id = parse_tinker_path(after.path)[0]
        store = CheckpointStore(checkpoints)
        assert store.checkpoint(run_id, "weights/after") is not None, "acknowledged, then lost from the store"
        store.close()
    expected = saved_weights(checkpoints, after.path)

    second = start_server(tmp_path / "second", stage, checkpoints)
    try:
        service = tinker.ServiceClient(base_url=second.base_url, api_key=API_KEY)
        resumed = service.create_training_client_from_state_with_optimizer(middle.path).result(timeout=120)
        assert resumed.get_info().lora_rank == 4
        assert train_step(resumed, *steps[2]) == uninterrupted, "same step count and accumulation after the restart"
        actual = saved_weights(checkpoints, resumed.save_state("after").result(timeout=RESULT_TIMEOUT_S).path)
        assert sorted(actual) == sorted(expected)
        for name in expected:  # same inputs, same Adam state, same ranks: bit for bit
            assert torch.equal(actual[name], expected[name]), name

        weights_only = service.create_training_client_from_state(middle.path).result(timeout=120)
        reloaded = saved_weights(checkpoints, weights_only.save_state("loaded").result(timeout=RESULT_TIMEOUT_S).path)
        for name, value in saved_weights(checkpoints, middle.path).items():
            assert torch.equal(reloaded[name], value), name
        last = service.create_training_client_from_state(after.path).result(timeout=120)
        for name, value in saved_weights(checkpoints, last.save_state("last").result(timeout=RESULT_TIMEOUT_S).path
                                         ).items():
            assert torch.equal(value, expected[name]), name
        service.close("success").result(timeout=30)
    finally:
        stop_server(second)
