"""The RL losses and their wire inputs, in-process: each equals its formula, value and gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinker_sdk_helpers import reference_elementwise_loss, require

require("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from examples.tinker_server.losses import elementwise_loss  # noqa: E402
from examples.tinker_server.wire import Datum, UserError, decode_forward_backward  # noqa: E402
from examples.tinker_server.worker import pad_inputs  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")

PROTO = "application/x-protobuf"
CONFIGS = {
    "cross_entropy": [None],
    "importance_sampling": [None],
    "ppo": [None, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}],
    "cispo": [None, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.1}],
}
DEFAULTS = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
            "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}}


def random_datums(rng: np.random.Generator, lengths: list[int]) -> list[dict]:
    """Datums whose sampling logprobs sit near, above and below the learner's, so clipping bites both ways."""
    out = []
    for n in lengths:
        out.append({"tokens": rng.integers(0, 50, n).tolist(), "targets": rng.integers(0, 50, n).tolist(),
                    "weights": rng.choice([0.0, 1.0, 2.0], n).tolist(),
                    "learner": rng.uniform(-4, -0.5, n), "shift": rng.normal(0, 0.4, n),
                    "advantages": rng.choice([-1.5, -0.5, 0.0, 0.5, 2.0], n).tolist()})
        out[-1]["logprobs"] = (out[-1]["learner"] + out[-1]["shift"]).tolist()
    return out


@pytest.mark.parametrize("loss_fn, config", [(k, c) for k, cs in CONFIGS.items() for c in cs])
def test_each_loss_equals_its_formula_in_value_and_gradient(loss_fn: str, config: dict | None) -> None:
    rng = np.random.default_rng(3)
    data = random_datums(rng, [5, 2, 7])
    wire = [Datum(np.array(d["tokens"]), np.array(d["targets"]), np.array(d["weights"], np.float32),
                  np.array(d["logprobs"], np.float32), np.array(d["advantages"], np.float32)) for d in data]
    _, inputs = pad_inputs(wire)
    padded = torch.full(inputs.mask.shape, -2.0)
    for i, d in enumerate(data):
        padded[i, :len(d["tokens"])] = torch.tensor(d["learner"], dtype=torch.float32)
    padded.requires_grad_(True)
    merged = {**DEFAULTS.get(loss_fn, {}), **(config or {})}
    served = elementwise_loss(loss_fn, padded, inputs, merged)
    served.sum().backward()

    for i, d in enumerate(data):
        n = len(d["tokens"])
        learner = torch.tensor(d["learner"], dtype=torch.float32, requires_grad=True)
        expected = reference_elementwise_loss(loss_fn, learner, d, config)
        expected.sum().backward()
        torch.testing.assert_close(served[i, :n].detach(), expected.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(padded.grad[i, :n], learner.grad, rtol=1e-6, atol=1e-6)
        assert not served[i, n:].detach().any() and not padded.grad[i, n:].any(), "padding adds nothing"
    if loss_fn == "ppo" or config is not None:  # the data must actually reach the clip
        ratio = torch.exp(padded.detach() - inputs.sampling_logprobs)[inputs.mask > 0]
        assert bool((ratio > merged["clip_high_threshold"]).any()), "no ratio above the upper threshold"


def encode(data: list[types.Datum], loss_fn: str, config: dict | None = None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="m", seq_id=1)
    return forward_backward_request_to_proto(request).SerializeToString()


def rl_datum(n: int = 3, **inputs) -> types.Datum:
    fields = {"target_tokens": list(range(1, n + 1)), "logprobs": [-1.0] * n, "advantages": [1.0] * n, **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints(list(range(n))),
                       loss_fn_inputs={k: v for k, v in fields.items() if v is not None})


def test_rl_inputs_and_clip_settings_decode_with_tinker_defaults() -> None:
    request = decode_forward_backward(encode([rl_datum(advantages=[0.5, -1.0, 2.0])], "ppo"), PROTO, None)
    assert request.loss_config == DEFAULTS["ppo"]
    datum = request.data[0]
    assert datum.sampling_logprobs.tolist() == [-1.0] * 3 and datum.advantages.tolist() == [0.5, -1.0, 2.0]
    custom = decode_forward_backward(encode([rl_datum()], "cispo", {"clip_high_threshold": 2.5}), PROTO, None)
    assert custom.loss_config == {"clip_low_threshold": 0.0, "clip_high_threshold": 2.5}
    assert decode_forward_backward(encode([rl_datum()], "importance_sampling"), PROTO, None).loss_config == {}


@pytest.mark.parametrize("data, loss_fn, config, message", [
    ([rl_datum(advantages=None)], "importance_sampling", None, "needs loss_fn_inputs"),
    ([rl_datum(logprobs=None)], "ppo", None, "needs loss_fn_inputs"),
    ([rl_datum(weights=[1.0] * 3)], "cispo", None, "not \\['weights'\\]"),
    ([rl_datum(advantages=[1.0])], "ppo", None, "lengths disagree"),
    ([rl_datum(logprobs=[0.0, float("nan"), 0.0])], "ppo", None, "must be finite"),
    ([rl_datum()], "importance_sampling", {"clip_low_threshold": 0.5}, "not accepted by importance_sampling"),
    ([rl_datum()], "ppo", {"clip_epsilon": 0.2}, "not accepted by ppo"),
    ([rl_datum()], "ppo", {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2}, "clip_low_threshold <="),
    ([rl_datum()], "dro", None, "unsupported loss function"),
])
def test_bad_rl_requests_are_user_errors(data, loss_fn: str, config, message: str) -> None:
    with pytest.raises(UserError, match=message):
        decode_forward_backward(encode(data, loss_fn, config), PROTO, None)
