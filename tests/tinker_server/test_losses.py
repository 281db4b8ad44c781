"""The losses and their wire inputs, in-process: each equals its formula, value and gradient."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from tinker_sdk_helpers import reference_elementwise_loss, require

require("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output  # noqa: E402

from deepspeed_tinker.losses import elementwise_loss  # noqa: E402
from deepspeed_tinker.wire import (  # noqa: E402
    Datum,
    FwdBwdResult,
    UserError,
    decode_forward_backward,
    encode_forward_backward_output,
)
from deepspeed_tinker.worker import pad_inputs, unpad  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")

PROTO = "application/x-protobuf"
CONFIGS = {
    "cross_entropy": [None],
    "importance_sampling": [None],
    "ppo": [None, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}],
    "cispo": [None, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.1}],
    "dro": [{"beta": 0.05}, {"beta": 0.7}],
    "gspo": [{"clip_low_threshold": 0.9, "clip_high_threshold": 1.05},
             {"clip_low_threshold": 0.95, "clip_high_threshold": 1.1}],
    "stable_reinforce": [None, {"clip_high_threshold": 1.1}],
}
DEFAULTS = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
            "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
            "stable_reinforce": {"clip_high_threshold": 2.0}}


def random_datums(rng: np.random.Generator, lengths: list[int]) -> list[dict]:
    """Datums whose sampling logprobs sit near, above and below the learner's, so clipping bites both ways;
    gspo's ratio mask leaves out a prompt-like prefix."""
    out = []
    for n in lengths:
        mask = np.ones(n, np.float32)
        mask[:n // 3] = 0.0
        out.append({"tokens": rng.integers(0, 50, n).tolist(), "targets": rng.integers(0, 50, n).tolist(),
                    "weights": rng.choice([0.0, 1.0, 2.0], n).tolist(),
                    "learner": rng.uniform(-4, -0.5, n), "shift": rng.normal(0, 0.4, n),
                    "advantages": rng.choice([-1.5, -0.5, 0.0, 0.5, 2.0], n).tolist(),
                    "sequence_ratio_mask": mask.tolist()})
        out[-1]["logprobs"] = (out[-1]["learner"] + out[-1]["shift"]).tolist()
    return out


def wire_datum(d: dict) -> Datum:
    return Datum(np.array(d["tokens"]), np.array(d["targets"]), np.array(d["weights"], np.float32),
                 np.array(d["logprobs"], np.float32), np.array(d["advantages"], np.float32),
                 np.array(d["sequence_ratio_mask"], np.float32))


def ratios_reaching_the_clip(loss_fn: str, data: list[dict], padded: torch.Tensor, inputs) -> torch.Tensor:
    """The ratios the clip sees: per token, or gspo's one per datum (the masked mean log-ratio)."""
    log_ratio = padded.detach() - inputs.sampling_logprobs
    if loss_fn != "gspo":
        return torch.exp(log_ratio)[inputs.mask > 0]
    return torch.stack([log_ratio[i, :len(d["tokens"])][torch.tensor(d["sequence_ratio_mask"]) != 0].mean().exp()
                        for i, d in enumerate(data)])


@pytest.mark.parametrize("loss_fn, config", [(k, c) for k, cs in CONFIGS.items() for c in cs])
def test_each_loss_equals_its_formula_in_value_and_gradient(loss_fn: str, config: dict | None) -> None:
    rng = np.random.default_rng(3)
    data = random_datums(rng, [5, 2, 7])
    _, inputs = pad_inputs([wire_datum(d) for d in data])
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
    if ("clip_high_threshold" in merged and config is not None) or loss_fn == "ppo":  # the data reach the clip
        ratio = ratios_reaching_the_clip(loss_fn, data, padded, inputs)
        assert bool((ratio > merged["clip_high_threshold"]).any()), "no ratio above the upper threshold"
        low = merged.get("clip_low_threshold", 0.0)
        assert bool((ratio < low).any()) or loss_fn in ("cispo", "stable_reinforce"), "none below the lower one"


def test_gspo_clips_one_sequence_ratio_over_the_masked_tokens() -> None:
    """By hand: token 0 is outside the mask, token 1's log-ratio is 0.5, so both tokens carry s = e^0.5.
    Per-token ratios (PPO) would give token 0 a ratio of 1; a mean over both tokens e^0.25."""
    datum = Datum(np.array([1, 2]), np.array([2, 3]), np.ones(2, np.float32), np.array([-1.0, -2.5], np.float32),
                  np.array([-1.0, -1.0], np.float32), np.array([0.0, 1.0], np.float32))
    _, inputs = pad_inputs([datum])
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss = elementwise_loss("gspo", logprobs, inputs, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    loss.sum().backward()
    s = math.exp(0.5)
    torch.testing.assert_close(loss.detach(), torch.tensor([[s, s]]))  # A < 0: min picks the unclipped s * A
    torch.testing.assert_close(logprobs.grad, torch.tensor([[s, s]]))  # each token: d(s_t)/d(logprob_t) = s


def test_dro_by_hand() -> None:
    datum = Datum(np.array([1]), np.array([2]), np.ones(1, np.float32), np.array([-1.5], np.float32),
                  np.array([2.0], np.float32))
    _, inputs = pad_inputs([datum])
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    loss = elementwise_loss("dro", logprobs, inputs, {"beta": 0.5})
    loss.sum().backward()
    # -(l * A - beta / 2 * (l - q)^2) = -(-2 - 0.0625); gradient -(A - beta * (l - q)) = -(2 - 0.25)
    torch.testing.assert_close(loss.detach(), torch.tensor([[2.0625]]))
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.75]]))


def soft_target_data(rng: np.random.Generator) -> list[Datum]:
    """[N, K] targets with teacher-like weights (0 in unused slots), K = 3 and 2, and a plain [N] datum."""
    out = []
    for n, k in ((4, 3), (2, 2), (3, 0)):
        shape = (n, k) if k else (n, )
        weights = rng.dirichlet(np.ones(k), n).astype(np.float32) if k else rng.choice([0.0, 1.0], n)
        if k:
            weights[0, -1] = 0.0
        out.append(Datum(rng.integers(0, 50, n), rng.integers(0, 50, shape), np.asarray(weights, np.float32)))
    return out


def test_top_k_cross_entropy_sums_every_weighted_target() -> None:
    """``-sum_t sum_k w[t, k] * log p(x[t, k])``, per target; [N] datums beside them keep their shape."""
    from deepspeed_tinker.model import build_model, token_logprobs

    torch.manual_seed(0)
    model = build_model("tiny-llama-byte", None)
    data = soft_target_data(np.random.default_rng(5))
    tokens, inputs = pad_inputs(data)
    assert inputs.targets.shape == (3, 4, 3) and inputs.weights.shape == (3, 4, 3)
    logprobs = token_logprobs(model, tokens, inputs.targets)
    served = elementwise_loss("cross_entropy", logprobs, inputs, {})
    served.sum().backward()
    served_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    expected_total = torch.zeros(())
    for i, d in enumerate(data):
        full = torch.log_softmax(model(input_ids=torch.from_numpy(d.tokens)[None]).logits[0].float(), dim=-1)
        targets = torch.from_numpy(d.targets)
        mine = full.gather(-1, targets if targets.dim() == 2 else targets[:, None])
        mine = mine if targets.dim() == 2 else mine[:, 0]
        expected = -(mine * torch.from_numpy(d.weights))
        expected_total = expected_total + expected.sum()
        assert unpad(served.detach(), d, i).shape == d.targets.shape
        torch.testing.assert_close(torch.from_numpy(unpad(served.detach(), d, i)), expected.detach(),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(unpad(logprobs.detach(), d, i)), mine.detach(),
                                   rtol=1e-5, atol=1e-6)
    expected_total.backward()
    for served_grad, p in zip(served_grads, model.parameters()):
        torch.testing.assert_close(served_grad, p.grad, rtol=1e-4, atol=1e-6)
    served = served.detach()
    assert abs(float(served.sum()) - float(expected_total.detach())) < 1e-4
    only_first = float(-(logprobs.detach()[0, :, 0] * inputs.weights[0, :, 0]).sum())
    assert abs(float(served[0].sum()) - only_first) > 1e-3, "the other K - 1 targets count too"


def test_top_k_targets_decode_from_the_sdk_dense_and_sparse() -> None:
    """The SDK sends [N, K] as dense tensors, or (torch tensors of target_tokens/weights) as sparse CSR."""
    targets = torch.zeros(3, 8, dtype=torch.long)
    weights = torch.zeros(3, 8)
    targets[0, :2], weights[0, :2] = torch.tensor([5, 7]), torch.tensor([0.6, 0.4])
    targets[1, 0], weights[1, 0] = 9, 1.0
    targets[2, 3], weights[2, 3] = 2, 0.5
    dense = types.Datum(model_input=types.ModelInput.from_ints([4, 5, 6]),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_torch(targets),
                                        "weights": types.TensorData.from_torch(weights)})
    sparse = types.Datum(model_input=types.ModelInput.from_ints([4, 5, 6]),
                         loss_fn_inputs={"target_tokens": targets, "weights": weights})
    assert all(sparse.loss_fn_inputs[k].sparse_crow_indices is not None for k in ("target_tokens", "weights"))
    for datum in decode_forward_backward(encode([dense, sparse], "cross_entropy"), PROTO, None).data:
        assert datum.targets.tolist() == targets.tolist() and datum.weights.tolist() == weights.tolist()


def test_the_sdk_reads_top_k_outputs_in_their_shape() -> None:
    logprobs = (np.full((2, 3), -1.0, np.float32), np.full((1, 3), -2.0, np.float32), np.array([-0.5], np.float32))
    output = deserialize_forward_backward_output(encode_forward_backward_output(FwdBwdResult(logprobs, logprobs)))
    assert [o["logprobs"].shape for o in output.loss_fn_outputs] == [[2, 3], [1, 3], [1]]
    decoded = [o["elementwise_loss"].to_numpy().tolist() for o in output.loss_fn_outputs]
    assert decoded == [a.tolist() for a in logprobs]
    assert output.metrics["loss:sum"] == pytest.approx(-6.0 - 6.0 - 0.5)


def encode(data: list[types.Datum], loss_fn: str, config: dict | None = None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="m", seq_id=1)
    return forward_backward_request_to_proto(request).SerializeToString()


def rl_datum(n: int = 3, **inputs) -> types.Datum:
    fields = {"target_tokens": list(range(1, n + 1)), "logprobs": [-1.0] * n, "advantages": [1.0] * n, **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints(list(range(n))),
                       loss_fn_inputs={k: v for k, v in fields.items() if v is not None})


GSPO = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def test_rl_inputs_and_clip_settings_decode_with_tinker_defaults() -> None:
    request = decode_forward_backward(encode([rl_datum(advantages=[0.5, -1.0, 2.0])], "ppo"), PROTO, None)
    assert request.loss_config == DEFAULTS["ppo"]
    datum = request.data[0]
    assert datum.sampling_logprobs.tolist() == [-1.0] * 3 and datum.advantages.tolist() == [0.5, -1.0, 2.0]
    custom = decode_forward_backward(encode([rl_datum()], "cispo", {"clip_high_threshold": 2.5}), PROTO, None)
    assert custom.loss_config == {"clip_low_threshold": 0.0, "clip_high_threshold": 2.5}
    assert decode_forward_backward(encode([rl_datum()], "importance_sampling"), PROTO, None).loss_config == {}
    assert decode_forward_backward(encode([rl_datum()], "dro", {"beta": 0.05}), PROTO, None).loss_config == {
        "beta": 0.05}
    gspo = decode_forward_backward(encode([rl_datum(sequence_ratio_mask=[0.0, 1.0, 1.0])], "gspo", GSPO), PROTO,
                                   None)
    assert gspo.loss_config == GSPO and gspo.data[0].sequence_ratio_mask.tolist() == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("data, loss_fn, config, message", [
    ([rl_datum(advantages=None)], "importance_sampling", None, "needs loss_fn_inputs"),
    ([rl_datum(logprobs=None)], "ppo", None, "needs loss_fn_inputs"),
    ([rl_datum(weights=[1.0] * 3)], "cispo", None, "not \\['weights'\\]"),
    ([rl_datum(advantages=[1.0])], "ppo", None, "lengths disagree"),
    ([rl_datum(logprobs=[0.0, float("nan"), 0.0])], "ppo", None, "must be finite"),
    ([rl_datum()], "importance_sampling", {"clip_low_threshold": 0.5}, "not accepted by importance_sampling"),
    ([rl_datum()], "ppo", {"clip_epsilon": 0.2}, "not accepted by ppo"),
    ([rl_datum()], "ppo", {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2}, "clip_low_threshold <="),
    ([rl_datum()], "stable_reinforce", {"clip_high_threshold": 0.0}, "clip_high_threshold > 0"),
    ([dataclasses.replace(rl_datum(), model_input_spans=[types.SampledProvenanceSpan(sequence_id="s", length=3)],
                          loss_fn_input_spans=[types.SampledProvenanceSpan(sequence_id="s", length=2)])],
     "stable_reinforce", None, "loss_fn_input_spans cover 2 positions"),
    ([rl_datum()], "dro", None, "dro needs loss_fn_config \\['beta'\\]"),
    ([rl_datum()], "dro", {"beta": -0.1}, "beta >= 0"),
    ([rl_datum(sequence_ratio_mask=[1.0] * 3)], "gspo", None, "gspo needs loss_fn_config"),
    ([rl_datum()], "gspo", GSPO, "needs loss_fn_inputs \\['sequence_ratio_mask'\\]"),
    ([rl_datum(sequence_ratio_mask=[0.0] * 3)], "gspo", GSPO, "marks no token"),
    ([rl_datum(sequence_ratio_mask=[1.0] * 2)], "gspo", GSPO, "lengths disagree"),
    ([rl_datum(advantages=np.ones((3, 2), np.float32))], "ppo", None, "must be 1-D"),
    ([rl_datum(target_tokens=np.ones((3, 2), np.int64))], "ppo", None, "must be 1-D"),
    ([rl_datum(logprobs=None, advantages=None, weights=np.ones((3, 2), np.float32))], "cross_entropy", None,
     "weights of shape \\[3, 2\\] for target_tokens of shape \\[3\\]"),
])
def test_bad_rl_requests_are_user_errors(data, loss_fn: str, config, message: str) -> None:
    with pytest.raises(UserError, match=message):
        decode_forward_backward(encode(data, loss_fn, config), PROTO, None)


def test_malformed_sparse_tensors_are_user_errors() -> None:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest.FromString(encode([rl_datum(logprobs=None, advantages=None)], "cross_entropy"))
    weights = msg.data[0].loss_fn_inputs["weights"]
    weights.dtype, weights.shape[:] = pb.DTYPE_FLOAT32, [3, 2]
    weights.sparse_csr.values = np.ones(2, np.float32).tobytes()
    weights.sparse_csr.crow_indices = np.array([0, 1, 2, 2], np.int64).tobytes()
    weights.sparse_csr.col_indices = np.array([0, 5], np.int64).tobytes()  # column 5 of 2
    with pytest.raises(UserError, match="malformed sparse CSR"):
        decode_forward_backward(msg.SerializeToString(), PROTO, None)
