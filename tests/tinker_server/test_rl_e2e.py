"""End to end, per ZeRO stage: the RL losses and custom losses through the official SDK.

One step mixes ``importance_sampling``, ``ppo`` (default and custom clips) and ``cispo`` calls,
the next adds a ``forward_backward_custom``; every call's ``loss:sum`` and logprobs, and the
weights after the steps, must equal a single-process plain-PyTorch replay that computes each loss
from its written-out formula (``reference_elementwise_loss``). Tolerances as in test_sdk_e2e, with
Adam's ``eps`` at 1e-4: RL gradients have many near-zero entries (zero advantages on prompt tokens),
which Adam with a tiny eps would scale up to ``lr * sign(noise)``; a larger eps keeps the comparison
about the losses, not about the sign of float noise. Full fine-tuning runs on ZeRO 3 only (LoRA on
every stage) to keep the suite short.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinker_sdk_helpers import require

tinker = require("tinker")
from tinker import types  # noqa: E402

from examples.tinker_server.model import LoraSpec  # noqa: E402
from tinker_sdk_helpers import (API_KEY, RESULT_TIMEOUT_S, PlainReplay, adam, assert_trained_like_replay,  # noqa: E402
                                reference_elementwise_loss)

pytestmark = pytest.mark.pr("zero-0-1")

WEIGHT_ATOL = 2e-5
LOGPROB_ATOL = 1e-4
BASE = "tiny-llama-byte"


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=30)


def rl_data(rng: np.random.Generator, replay: PlainReplay, n: int) -> list[dict]:
    """Datums as a sampler would produce them: sampling logprobs near the learner's current ones
    (so importance ratios sit around 1 and the clips bite), advantages of both signs, zero on prompts."""
    data = []
    for _ in range(n):
        length = int(rng.integers(4, 12))
        tokens, targets = rng.integers(0, 256, length).tolist(), rng.integers(0, 256, length).tolist()
        learner = replay.logprobs(tokens, targets)
        prompt = int(rng.integers(1, length - 1))
        advantages = [0.0] * prompt + [float(rng.choice([-1.0, -0.25, 0.5, 1.5]))] * (length - prompt)
        data.append({"tokens": tokens, "targets": targets, "advantages": advantages,
                     "logprobs": (learner + rng.normal(0, 0.3, length)).astype(np.float32).tolist()})
    return data


def to_sdk(data: list[dict]) -> list[types.Datum]:
    return [types.Datum(model_input=types.ModelInput.from_ints(d["tokens"]),
                        loss_fn_inputs={"target_tokens": d["targets"], "logprobs": d["logprobs"],
                                        "advantages": d["advantages"]}) for d in data]


def custom_loss(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """A loss no built-in computes: squared logprobs, weighted by position."""
    total = sum(((lp**2) * torch.linspace(0.1, 1.0, len(lp))).sum() for lp in logprobs)
    return total, {"custom": float(total.detach())}


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_rl_losses_train_exactly_as_their_formulas(server, service, lora_rank: int) -> None:
    if lora_rank == 0 and server.zero_stage != 3:
        pytest.skip("full fine-tuning is covered on ZeRO 3, the stage that shards the parameters")
    rng = np.random.default_rng(40 + lora_rank)
    training = service.create_lora_training_client(base_model=BASE, rank=lora_rank, seed=5).result(timeout=120)
    replay = PlainReplay(BASE, LoraSpec(rank=lora_rank, seed=5) if lora_rank else None)
    tight = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    steps = [
        ([("importance_sampling", 3, None), ("ppo", 5, None), ("cispo", 2, None), ("ppo", 2, tight)],
         adam(learning_rate=1e-2, eps=1e-4)),
        ([("cispo", 3, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.2}), ("custom", 2, None),
          ("importance_sampling", 1, None)], adam(learning_rate=2e-2, eps=1e-4, grad_clip_norm=0.5)),
    ]
    for calls, params in steps:
        batches = [(loss, rl_data(rng, replay, n), config) for loss, n, config in calls]
        futures = []
        for loss, data, config in batches:
            if loss == "custom":
                plain = [types.Datum(model_input=types.ModelInput.from_ints(d["tokens"]),
                                     loss_fn_inputs={"target_tokens": d["targets"]}) for d in data]
                futures.append(training.forward_backward_custom(plain, custom_loss))
            else:
                futures.append(training.forward_backward(to_sdk(data), loss, loss_fn_config=config))
        optim = training.optim_step(types.AdamParams(**params))

        for (loss, data, config), future in zip(batches, futures):
            output = future.result(timeout=RESULT_TIMEOUT_S)
            if loss == "custom":
                expected_lp, expected = replay.loss_backward(
                    data, lambda d, lp: (lp**2) * torch.linspace(0.1, 1.0, len(lp)))
                assert output.metrics["custom"] == pytest.approx(expected, rel=1e-4)
            else:
                expected_lp, expected = replay.loss_backward(
                    data, lambda d, lp, loss=loss, config=config: reference_elementwise_loss(loss, lp, d, config))
            assert output.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4), loss
            for got, want in zip(output.loss_fn_outputs, expected_lp):
                np.testing.assert_allclose(got["logprobs"].data, want, atol=LOGPROB_ATOL)
        assert optim.result(timeout=RESULT_TIMEOUT_S).metrics["fwdbwd_requests:sum"] >= len(calls)
        replay.optim_step(params)

    assert_trained_like_replay(training, server, replay, "rl-final", WEIGHT_ATOL)
