"""Wire formats against the SDK's own encoder and decoder (no server, no DeepSpeed)."""

from __future__ import annotations

import numpy as np
import pytest
from tinker_sdk_helpers import require

tinker = require("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output  # noqa: E402

from deepspeed_tinker.wire import (  # noqa: E402
    FwdBwdResult,
    UserError,
    check_against_model,
    decode_forward_backward,
    encode_forward_backward_output,
)

pytestmark = pytest.mark.pr("zero-0-1")
PROTO = "application/x-protobuf"


def datum(tokens: list[int], targets: list[int] | None = None, weights: list[float] | None = None) -> types.Datum:
    targets = tokens[1:] + [0] if targets is None else targets
    inputs: dict = {"target_tokens": targets}
    if weights is not None:
        inputs["weights"] = weights
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def encode(data: list[types.Datum], loss_fn: str = "cross_entropy", seq_id: int = 1, compress: bool = False):
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn), model_id="m", seq_id=seq_id)
    body = forward_backward_request_to_proto(request).SerializeToString()
    if compress:
        import zstandard

        return zstandard.ZstdCompressor().compress(body), "zstd"
    return body, None


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "zstd"])
def test_decodes_what_the_sdk_encodes(compress: bool) -> None:
    body, encoding = encode([datum([1, 2, 3], [2, 3, 4], [1.0, 0.5, 0.0]), datum([7, 8])], compress=compress)
    request = decode_forward_backward(body, PROTO, encoding)
    assert (request.model_id, request.seq_id, request.loss_fn) == ("m", 1, "cross_entropy")
    assert not request.forward_only
    first, second = request.data
    assert first.tokens.tolist() == [1, 2, 3] and first.targets.tolist() == [2, 3, 4]
    assert first.weights.tolist() == [1.0, 0.5, 0.0]
    assert second.weights.tolist() == [1.0, 1.0], "weights default to 1"


@pytest.mark.parametrize("data, loss_fn, message", [
    ([datum([1, 2, 3], [2, 3])], "cross_entropy", "lengths disagree"),
    ([datum([1, 2, 3], [2, 3, 4], [1.0])], "cross_entropy", "lengths disagree"),
    ([datum([1, 2])], "reinforce", "unsupported loss function"),
    ([], "cross_entropy", "at least one datum"),
])
def test_bad_requests_are_user_errors(data, loss_fn: str, message: str) -> None:
    body, _ = encode(data, loss_fn)
    with pytest.raises(UserError, match=message):
        decode_forward_backward(body, PROTO, None)


@pytest.mark.parametrize("body, content_type, encoding, message", [
    (b"\xff\xff\xff not a protobuf", PROTO, None, "malformed ForwardBackwardRequest"),
    (b"\x28\xb5\x2f\xfd garbage", PROTO, "zstd", "malformed zstd"),
    (b"{}", "application/json", None, "expects application/x-protobuf"),
])
def test_undecodable_bodies_are_user_errors(body: bytes, content_type: str, encoding, message: str) -> None:
    with pytest.raises(UserError, match=message):
        decode_forward_backward(body, content_type, encoding)


def test_token_ids_are_checked_against_the_vocabulary() -> None:
    for tokens, targets in (([1, 256], [2, 3]), ([1, 2], [2, -1]), ([1, 2], [2, 999])):
        request = decode_forward_backward(encode([datum(tokens, targets)])[0], PROTO, None)
        with pytest.raises(UserError, match="outside the vocabulary"):
            check_against_model(request, vocab_size=256, max_context_length=64)
    long_request = decode_forward_backward(encode([datum(list(range(10)))])[0], PROTO, None)
    with pytest.raises(UserError, match="context length"):
        check_against_model(long_request, vocab_size=256, max_context_length=8)


def test_the_sdk_decodes_our_output() -> None:
    logprobs = (np.array([-1.0, -2.0], np.float32), np.array([-0.5], np.float32))
    losses = (np.array([1.0, 0.0], np.float32), np.array([0.5], np.float32))
    output = deserialize_forward_backward_output(encode_forward_backward_output(FwdBwdResult(logprobs, losses)))
    assert output.metrics == {"loss:sum": 1.5}
    assert [o["logprobs"].data for o in output.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert [o["elementwise_loss"].shape for o in output.loss_fn_outputs] == [[2], [1]]
