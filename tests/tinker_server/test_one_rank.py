"""A server of one rank runs each job without the broadcast and gather (``server._on_every_rank``): the official SDK
against it trains exactly as the 2-rank servers do, equal to a plain-PyTorch replay, and its forward answers too.
Tolerances as in test_sdk_e2e.py (the replay sums datum by datum, the server over a padded batch)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from tinker_sdk_helpers import require

tinker = require("tinker")
from tinker import types  # noqa: E402
from tinker_sdk_helpers import (  # noqa: E402
    API_KEY,
    RESULT_TIMEOUT_S,
    PlainReplay,
    adam,
    assert_forward_backward_like_replay,
    assert_trained_like_replay,
    random_data,
    start_server,
    stop_server,
    to_sdk,
)

from deepspeed_tinker.model import LoraSpec  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")

BASE = "tiny-llama-byte"
WEIGHT_ATOL = 2e-5
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    tmp_dir = Path(tmp_path_factory.mktemp("tinker-one-rank"))
    server = start_server(tmp_dir, 1, world_size=1)
    server.checkpoint_dir = tmp_dir / "ckpt"
    try:
        yield server
    finally:
        stop_server(server)


def test_one_rank_trains_like_a_plain_pytorch_replay(server) -> None:
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    rng = np.random.default_rng(5)
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=11).result(timeout=120)
    replay = PlainReplay(BASE, LoraSpec(rank=4, seed=11))
    for calls, params in [([3, 2], adam(learning_rate=1e-2)), ([5], adam(learning_rate=2e-2, grad_clip_norm=0.05))]:
        batches = [random_data(rng, n) for n in calls]
        futures = [training.forward_backward(to_sdk(batch), "cross_entropy") for batch in batches]
        optim = training.optim_step(types.AdamParams(**params))
        for batch, future in zip(batches, futures):
            assert_forward_backward_like_replay(future, replay, batch, LOGPROB_ATOL)
        assert optim.result(timeout=RESULT_TIMEOUT_S).metrics["datums:sum"] == sum(calls)
        replay.optim_step(params)
    assert_trained_like_replay(training, server, replay, "final", WEIGHT_ATOL)
    service.close("success").result(timeout=30)
