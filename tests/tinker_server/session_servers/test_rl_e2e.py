"""End to end, per ZeRO stage: the RL losses and custom losses through the official SDK.

One step mixes ``importance_sampling``, ``ppo`` (default and custom clips) and ``cispo`` calls,
the next adds a ``forward_backward_custom``; another step mixes ``dro``, ``gspo``, ``cross_entropy``
with ``[N, K]`` targets (sent dense and sparse) and a ``forward_backward_custom`` over ``[N, K]``
logprobs. Every call's ``loss:sum`` and logprobs, and the weights after the steps, must equal a
single-process plain-PyTorch replay that computes each loss from its written-out formula
(``reference_elementwise_loss``). Tolerances as in test_sdk_e2e, with
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
from tinker_sdk_helpers import (  # noqa: E402
    API_KEY,
    RESULT_TIMEOUT_S,
    PlainReplay,
    adam,
    assert_trained_like_replay,
    reference_elementwise_loss,
)

from deepspeed_tinker.model import LoraSpec  # noqa: E402

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


def top_k_data(rng: np.random.Generator, n: int, k: int) -> list[dict]:
    """[N, K] targets with teacher-like weights on 2 of the K slots (0 elsewhere, so the SDK may send CSR);
    one datum of plain [N] targets rides along."""
    data = []
    for i in range(n):
        length = int(rng.integers(3, 9))
        tokens = rng.integers(0, 256, length).tolist()
        if i == n - 1:
            data.append({"tokens": tokens, "targets": rng.integers(0, 256, length).tolist(),
                         "weights": rng.choice([0.0, 1.0], length).tolist()})
            continue
        weights, targets = np.zeros((length, k), np.float32), np.zeros((length, k), np.int64)
        weights[:, :2], targets[:, :2] = rng.dirichlet(np.ones(2), length), rng.integers(0, 256, (length, 2))
        data.append({"tokens": tokens, "targets": targets.tolist(), "weights": weights.tolist()})
    return data


def top_k_to_sdk(data: list[dict], sparse: bool) -> list[types.Datum]:
    def tensor(values, dtype):
        array = torch.tensor(values, dtype=dtype)
        return array if sparse and array.dim() == 2 else types.TensorData.from_torch(array)

    return [types.Datum(model_input=types.ModelInput.from_ints(d["tokens"]),
                        loss_fn_inputs={"target_tokens": tensor(d["targets"], torch.long),
                                        "weights": tensor(d["weights"], torch.float32)}) for d in data]


def top_k_custom_loss(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Non-linear in the [N, K] logprobs, with a gradient only where the weights are: the SDK sends it sparse."""
    total = sum((lp.exp() * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs))
    return total, {}


def replay_formula(loss: str, config: dict | None):
    """The elementwise loss the replay differentiates: a built-in's formula, or the custom loss above."""
    if loss == "custom":
        return lambda d, lp: lp.exp() * torch.tensor(d["weights"])
    if loss == "cross_entropy":  # [N] or [N, K]: -sum of weight * logprob over every target
        return lambda d, lp: -lp * torch.tensor(d["weights"])
    return lambda d, lp: reference_elementwise_loss(loss, lp, d, config)


def test_dro_gspo_and_top_k_cross_entropy_train_exactly_as_their_formulas(server, service) -> None:
    rng = np.random.default_rng(47)
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=6).result(timeout=120)
    replay = PlainReplay(BASE, LoraSpec(rank=4, seed=6))
    dro = rl_data(rng, replay, 3)
    gspo = rl_data(rng, replay, 3)
    for d in gspo:
        d["sequence_ratio_mask"] = [float(a != 0.0) for a in d["advantages"]]
    gspo_sdk = [types.Datum(model_input=datum.model_input,
                            loss_fn_inputs={**datum.loss_fn_inputs, "sequence_ratio_mask": d["sequence_ratio_mask"]})
                for datum, d in zip(to_sdk(gspo), gspo)]
    dense, sparse, custom = top_k_data(rng, 3, 4), top_k_data(rng, 3, 8), top_k_data(rng, 2, 8)
    calls = [("dro", dro, to_sdk(dro), {"beta": 0.3}),
             ("gspo", gspo, gspo_sdk, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
             ("cross_entropy", dense, top_k_to_sdk(dense, sparse=False), None),
             ("cross_entropy", sparse, top_k_to_sdk(sparse, sparse=True), None),
             ("custom", custom, top_k_to_sdk(custom, sparse=False), None)]
    assert all(d.loss_fn_inputs["weights"].sparse_crow_indices is not None for d in calls[3][2][:-1]), "CSR sent"
    futures = [training.forward_backward_custom(sdk, top_k_custom_loss) if loss == "custom"
               else training.forward_backward(sdk, loss, loss_fn_config=config) for loss, _, sdk, config in calls]
    params = adam(learning_rate=1e-2, eps=1e-4)
    optim = training.optim_step(types.AdamParams(**params))

    for (loss, data, _, config), future in zip(calls, futures):
        output = future.result(timeout=RESULT_TIMEOUT_S)
        expected_lp, expected = replay.loss_backward(data, replay_formula(loss, config))
        assert output.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4), loss
        for got, want in zip(output.loss_fn_outputs, expected_lp):
            assert got["logprobs"].shape == list(want.shape), loss
            np.testing.assert_allclose(got["logprobs"].to_numpy(), want, atol=LOGPROB_ATOL)
    assert optim.result(timeout=RESULT_TIMEOUT_S).metrics["fwdbwd_requests:sum"] >= len(calls)
    replay.optim_step(params)
    assert_trained_like_replay(training, server, replay, "rl-topk-final", WEIGHT_ATOL)
