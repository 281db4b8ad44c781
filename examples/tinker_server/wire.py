"""Tinker wire formats: decode and validate requests, encode results.

Uses the protobuf modules that ship inside the official SDK (``tinker.proto``), so the server
reads exactly what the SDK writes. Everything here is pure data handling (numpy, no torch), so
it can be tested without DeepSpeed or a network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: The built-in losses, each a SUM over tokens (see ``losses.py`` for the formulas), and the
#: ``loss_fn_inputs`` each takes (required, optional).
LOSS_INPUTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "cross_entropy": (frozenset({"target_tokens"}), frozenset({"weights"})),
    "importance_sampling": (frozenset({"target_tokens", "logprobs", "advantages"}), frozenset()),
    "ppo": (frozenset({"target_tokens", "logprobs", "advantages"}), frozenset()),
    "cispo": (frozenset({"target_tokens", "logprobs", "advantages"}), frozenset()),
}
SUPPORTED_LOSS_FNS = tuple(LOSS_INPUTS)

#: ``loss_fn_config`` keys each loss accepts, with Tinker's defaults (ratio thresholds, not epsilons).
LOSS_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
}

PROTO_CONTENT_TYPE = "application/x-protobuf"


class UserError(Exception):
    """A request the client got wrong; reported in the future's result as category ``user``."""


@dataclass(frozen=True)
class Datum:
    """One training example, flattened: token ``t`` is scored against ``targets[t]``.

    ``weights`` is for ``cross_entropy``; the RL losses read the sampler's ``sampling_logprobs``
    and the ``advantages`` instead (their ``weights`` are ones, unused).
    """

    tokens: np.ndarray  # int64 [L]
    targets: np.ndarray  # int64 [L]
    weights: np.ndarray  # float32 [L]
    sampling_logprobs: np.ndarray | None = None  # float32 [L]
    advantages: np.ndarray | None = None  # float32 [L]


@dataclass(frozen=True)
class FwdBwdRequest:
    """A decoded ``forward_backward`` (or ``forward``, when ``forward_only``) request."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    data: tuple[Datum, ...]
    #: The loss's clip settings, defaults filled in (empty for losses without any).
    loss_config: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class FwdBwdResult:
    """Per-datum outputs of one request, in request order."""

    logprobs: tuple[np.ndarray, ...]
    elementwise_loss: tuple[np.ndarray, ...]

    @property
    def loss_sum(self) -> float:
        return float(sum(float(x.sum(dtype=np.float64)) for x in self.elementwise_loss))


def _pb():
    """The SDK's generated protobuf module (imported lazily: it pulls in the whole SDK)."""
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def decompress(body: bytes, content_encoding: str | None) -> bytes:
    """Undo the SDK's optional zstd compression of ``forward_backward`` bodies."""
    if not content_encoding or content_encoding == "identity":
        return body
    if content_encoding != "zstd":
        raise UserError(f"unsupported Content-Encoding {content_encoding!r} (only zstd)")
    import zstandard

    try:
        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    except zstandard.ZstdError as e:
        raise UserError(f"malformed zstd body: {e}") from None


def _tensor(msg: Any, name: str) -> np.ndarray:
    """A dense 1-D ``Tensor`` as numpy; sparse or multi-dimensional tensors are refused."""
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise UserError(f"loss_fn_inputs[{name!r}]: unsupported dtype {msg.dtype}")
    if msg.WhichOneof("encoding") != "dense":
        raise UserError(f"loss_fn_inputs[{name!r}]: only dense tensors are supported")
    itemsize = np.dtype(dtypes[msg.dtype]).itemsize
    if len(msg.dense) % itemsize:
        raise UserError(f"loss_fn_inputs[{name!r}]: {len(msg.dense)} bytes is not a whole number of items")
    array = np.frombuffer(msg.dense, dtype=dtypes[msg.dtype])
    shape = list(msg.shape) or [array.size]
    if len(shape) != 1 or shape[0] != array.size:
        raise UserError(f"loss_fn_inputs[{name!r}]: shape {shape} does not match {array.size} elements "
                        "(only 1-D tensors are supported)")
    return array


def _float_input(inputs: dict[str, Any], name: str, index: int) -> np.ndarray:
    values = _tensor(inputs[name], name).astype(np.float32)
    if not np.all(np.isfinite(values)):
        raise UserError(f"data[{index}]: {name} must be finite")
    return values


def _datum(msg: Any, index: int, loss_fn: str = "cross_entropy") -> Datum:
    pieces = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"data[{index}]: only encoded_text chunks are supported, got {kind}")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise UserError(f"data[{index}]: token bytes are not int32")
        pieces.append(np.frombuffer(raw, dtype=np.int32))
    tokens = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)
    inputs = dict(msg.loss_fn_inputs)
    required, optional = LOSS_INPUTS[loss_fn]
    unknown = sorted(set(inputs) - required - optional)
    if unknown:
        raise UserError(f"data[{index}]: {loss_fn} takes {sorted(required | optional)}, not {unknown}")
    missing = sorted(required - set(inputs))
    if missing:
        raise UserError(f"data[{index}]: {loss_fn} needs loss_fn_inputs {missing}")
    targets = _tensor(inputs["target_tokens"], "target_tokens")
    if targets.dtype == np.float32:
        raise UserError(f"data[{index}]: target_tokens must be integers")
    weights = (_float_input(inputs, "weights", index)
               if "weights" in inputs else np.ones(len(targets), np.float32))
    sampling_logprobs = _float_input(inputs, "logprobs", index) if "logprobs" in inputs else None
    advantages = _float_input(inputs, "advantages", index) if "advantages" in inputs else None
    lengths = {"input tokens": len(tokens), "target_tokens": len(targets), "weights": len(weights)}
    if sampling_logprobs is not None:
        lengths["logprobs"] = len(sampling_logprobs)
    if advantages is not None:
        lengths["advantages"] = len(advantages)
    if len(set(lengths.values())) != 1:
        raise UserError(f"data[{index}]: lengths disagree: " + ", ".join(f"{n} {k}" for k, n in lengths.items()))
    if len(tokens) == 0:
        raise UserError(f"data[{index}]: empty model_input")
    return Datum(tokens, targets.astype(np.int64), weights, sampling_logprobs, advantages)


def loss_config(msg: Any) -> dict[str, float]:
    """The request's ``loss_fn_config`` for its loss, defaults filled in; unknown keys are refused."""
    raw: dict[str, float] = {}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise UserError(f"loss_fn_config[{key!r}] must be a number")
        raw[key] = float(value.number)
    for key, value in msg.loss_fn_config.items():  # the older map the SDK still fills
        raw.setdefault(key, float(value))
    defaults = LOSS_CONFIG_DEFAULTS[msg.loss_fn]
    unknown = sorted(set(raw) - set(defaults))
    if unknown:
        accepted = sorted(defaults) or "no keys"
        raise UserError(f"loss_fn_config {unknown} is not accepted by {msg.loss_fn} (it takes {accepted})")
    config = {**defaults, **raw}
    if not all(np.isfinite(v) for v in config.values()):
        raise UserError("loss_fn_config values must be finite")
    if config and not 0 <= config["clip_low_threshold"] <= config["clip_high_threshold"]:
        raise UserError("loss_fn_config: need 0 <= clip_low_threshold <= clip_high_threshold, got "
                        f"{config['clip_low_threshold']} and {config['clip_high_threshold']}")
    return config


def parse_forward_backward(body: bytes, content_type: str | None, content_encoding: str | None) -> Any:
    """The ``ForwardBackwardRequest`` protobuf message; a body that is not one is a user error."""
    if PROTO_CONTENT_TYPE not in (content_type or ""):
        raise UserError(f"forward_backward expects {PROTO_CONTENT_TYPE}, got {content_type!r}")
    from google.protobuf.message import DecodeError

    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(decompress(body, content_encoding))
    except DecodeError as e:
        raise UserError(f"malformed ForwardBackwardRequest protobuf: {e}") from None
    return msg


def validate_forward_backward(msg: Any, forward_only: bool = False) -> FwdBwdRequest:
    """Structural checks of a parsed request (model-specific checks come later)."""
    if msg.loss_fn not in SUPPORTED_LOSS_FNS:
        raise UserError(f"unsupported loss function {msg.loss_fn!r}; this server supports {list(SUPPORTED_LOSS_FNS)}")
    if len(msg.data) == 0:
        raise UserError("forward_backward needs at least one datum")
    config = loss_config(msg)
    data = tuple(_datum(datum, i, msg.loss_fn) for i, datum in enumerate(msg.data))
    return FwdBwdRequest(msg.model_id, int(msg.seq_id), msg.loss_fn, forward_only or bool(msg.forward_only), data,
                         config)


def decode_forward_backward(body: bytes, content_type: str | None, content_encoding: str | None) -> FwdBwdRequest:
    """Parse and validate in one go."""
    return validate_forward_backward(parse_forward_backward(body, content_type, content_encoding))


def check_against_model(request: FwdBwdRequest, vocab_size: int, max_context_length: int) -> None:
    """Checks that need the model: token ids in the vocabulary, lengths within the context."""
    for i, datum in enumerate(request.data):
        for name, ids in (("model_input", datum.tokens), ("target_tokens", datum.targets)):
            bad = ids[(ids < 0) | (ids >= vocab_size)]
            if bad.size:
                raise UserError(f"data[{i}]: {name} has token id {int(bad[0])} outside the vocabulary "
                                f"[0, {vocab_size})")
        if len(datum.tokens) > max_context_length:
            raise UserError(f"data[{i}]: {len(datum.tokens)} tokens exceed the context length {max_context_length}")


def encode_forward_backward_output(result: FwdBwdResult) -> bytes:
    """The ``ForwardBackwardOutput`` protobuf the SDK decodes: one batched ``ArrayRecord``."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.metrics["loss:sum"] = result.loss_sum
    record = out.loss_fn_outputs.add(num_datums=len(result.logprobs))
    for name, arrays in (("logprobs", result.logprobs), ("elementwise_loss", result.elementwise_loss)):
        arrays32 = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays32], dtype=np.int64)
        field = record.fields[name]
        field.dtype = pb.DTYPE_FLOAT32
        field.data = b"".join(a.tobytes() for a in arrays32)
        field.offsets = offsets.tobytes()
    return out.SerializeToString()


def forward_backward_output_json(result: FwdBwdResult) -> dict[str, Any]:
    """The same result as JSON, for clients that do not ask for protobuf (e.g. curl)."""

    def tensor(a: np.ndarray) -> dict[str, Any]:
        return {"data": [float(x) for x in a], "dtype": "float32", "shape": [len(a)]}

    return {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": [{"logprobs": tensor(lp), "elementwise_loss": tensor(el)}
                            for lp, el in zip(result.logprobs, result.elementwise_loss)],
        "metrics": {"loss:sum": result.loss_sum},
    }


def parse_json(body: bytes) -> dict[str, Any]:
    """A JSON object body, or a user error saying why not."""
    try:
        value = json.loads(body or b"{}")
    except ValueError as e:
        raise UserError(f"malformed JSON body: {e}") from None
    if not isinstance(value, dict):
        raise UserError("request body must be a JSON object")
    return value
