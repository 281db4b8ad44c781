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

from .errors import UserError

#: The built-in losses, each a SUM over tokens (see ``losses.py`` for the formulas), and the
#: ``loss_fn_inputs`` each takes (required, optional).
LOSS_INPUTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "cross_entropy": (frozenset({"target_tokens"}), frozenset({"weights"})),
    "importance_sampling": (frozenset({"target_tokens", "logprobs", "advantages"}), frozenset()),
    "ppo": (frozenset({"target_tokens", "logprobs", "advantages"}), frozenset()),
    "cispo": (frozenset({"target_tokens", "logprobs", "advantages"}), frozenset()),
    "dro": (frozenset({"target_tokens", "logprobs", "advantages"}), frozenset()),
    "gspo": (frozenset({"target_tokens", "logprobs", "advantages", "sequence_ratio_mask"}), frozenset()),
    # The sampler's logprobs come from the record the provenance names; the client's copy is not needed.
    "stable_reinforce": (frozenset({"target_tokens", "advantages"}), frozenset({"logprobs"})),
}
SUPPORTED_LOSS_FNS = tuple(LOSS_INPUTS)
#: Losses whose ``target_tokens`` (and ``weights``) may be ``[N, K]``: K targets per position (top-K distillation).
SOFT_TARGET_LOSSES = frozenset({"cross_entropy"})

#: ``loss_fn_config`` keys each loss accepts, with Tinker's defaults (ratio thresholds, not epsilons).
LOSS_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {},
    "gspo": {},
    # This server's truncation of the importance weight (losses.stable_reinforce); not a Tinker default.
    "stable_reinforce": {"clip_high_threshold": 2.0},
}
#: Keys a loss needs in ``loss_fn_config``: Tinker's docs define them but publish no default, so none is guessed.
LOSS_CONFIG_REQUIRED: dict[str, frozenset[str]] = {
    "dro": frozenset({"beta"}),
    "gspo": frozenset({"clip_low_threshold", "clip_high_threshold"}),
}
#: Losses whose datums name, with provenance spans, the recorded sampled sequence behind each position.
PROVENANCE_LOSSES = frozenset({"stable_reinforce"})
#: Why a loss of the SDK's ``LossFnType`` is refused, for the error message.
UNSUPPORTED_LOSS_REASONS: dict[str, str] = {}
#: The per-token float inputs besides ``weights``: ``Datum`` field -> ``loss_fn_inputs`` name.
PER_TOKEN_INPUTS = {"sampling_logprobs": "logprobs", "advantages": "advantages",
                    "sequence_ratio_mask": "sequence_ratio_mask"}
#: A sparse tensor is densified on arrival: refuse shapes no datum could need before allocating them.
MAX_TENSOR_ELEMENTS = 1 << 26

PROTO_CONTENT_TYPE = "application/x-protobuf"


@dataclass(frozen=True)
class Span:
    """A provenance run: ``length`` positions that are positions ``offset ..`` of a recorded sequence's sampled
    tokens (``sampled``) or of its request's prompt."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class Datum:
    """One training example, flattened: token ``t`` is scored against ``targets[t]``.

    ``targets`` and ``weights`` are ``[L]``, or ``[L, K]`` for ``cross_entropy`` with K targets per
    position (top-K soft targets). ``weights`` is for ``cross_entropy``; the RL losses read the
    sampler's ``sampling_logprobs`` and the ``advantages`` instead (their ``weights`` are ones, unused),
    and ``gspo`` the ``sequence_ratio_mask`` too.
    """

    tokens: np.ndarray  # int64 [L]
    targets: np.ndarray  # int64 [L] or [L, K]
    weights: np.ndarray  # float32, the shape of targets
    sampling_logprobs: np.ndarray | None = None  # float32 [L]
    advantages: np.ndarray | None = None  # float32 [L]
    sequence_ratio_mask: np.ndarray | None = None  # float32 [L]; != 0 marks gspo's sequence-ratio tokens
    #: Provenance (``stable_reinforce``): runs tiling ``tokens`` and ``targets``; None when the datum has none.
    input_spans: tuple[Span, ...] | None = None
    target_spans: tuple[Span, ...] | None = None


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
    """Per-datum outputs of one request, in request order (``[N]``, or ``[N, K]`` for ``[N, K]`` targets)."""

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


def _array(raw: bytes, dtype: Any, name: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(raw) % itemsize:
        raise UserError(f"loss_fn_inputs[{name!r}]: {len(raw)} bytes is not a whole number of items")
    return np.frombuffer(raw, dtype=dtype)


def _from_csr(csr: Any, dtype: Any, shape: list[int], name: str) -> np.ndarray:
    """A sparse CSR tensor densified: unlisted entries are 0 (the wire carries no other pad value)."""
    if len(shape) != 2 or min(shape) < 0 or shape[0] * shape[1] > MAX_TENSOR_ELEMENTS:
        raise UserError(f"loss_fn_inputs[{name!r}]: a sparse tensor needs a 2-D shape, got {shape}")
    values = _array(csr.values, dtype, name)
    crow = _array(csr.crow_indices, np.int64, name)
    col = _array(csr.col_indices, np.int64, name)
    rows, cols = shape
    if (len(crow) != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != len(col)
            or len(col) != len(values) or np.any((col < 0) | (col >= cols))):
        raise UserError(f"loss_fn_inputs[{name!r}]: malformed sparse CSR tensor of shape {shape}")
    row = np.repeat(np.arange(rows), np.diff(crow))
    if len(np.unique(row * cols + col)) != len(col):
        raise UserError(f"loss_fn_inputs[{name!r}]: sparse CSR tensor lists an entry twice")
    dense = np.zeros(shape, dtype=dtype)
    dense[row, col] = values
    return dense


def _tensor(msg: Any, name: str, max_dims: int = 1) -> np.ndarray:
    """A ``Tensor`` (dense, or sparse CSR) as a numpy array of at most ``max_dims`` dimensions."""
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise UserError(f"loss_fn_inputs[{name!r}]: unsupported dtype {msg.dtype}")
    shape = [int(s) for s in msg.shape]
    encoding = msg.WhichOneof("encoding")
    if encoding == "sparse_csr":
        array = _from_csr(msg.sparse_csr, dtypes[msg.dtype], shape, name)
    elif encoding == "dense":
        array = _array(msg.dense, dtypes[msg.dtype], name)
        shape = shape or [array.size]
        if min(shape) < 0 or int(np.prod(shape)) != array.size:
            raise UserError(f"loss_fn_inputs[{name!r}]: shape {shape} does not match {array.size} elements")
        array = array.reshape(shape)
    else:
        raise UserError(f"loss_fn_inputs[{name!r}]: a tensor without data")
    if not 1 <= array.ndim <= max_dims:
        allowed = "1-D ([N]) or 2-D ([N, K])" if max_dims == 2 else "1-D ([N])"
        raise UserError(f"loss_fn_inputs[{name!r}]: shape {list(array.shape)}; this input must be {allowed}")
    return array


def _float_input(inputs: dict[str, Any], name: str, index: int, max_dims: int = 1) -> np.ndarray:
    values = _tensor(inputs[name], name, max_dims).astype(np.float32)
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
    dims = 2 if loss_fn in SOFT_TARGET_LOSSES else 1
    targets = _tensor(inputs["target_tokens"], "target_tokens", dims)
    if targets.dtype == np.float32:
        raise UserError(f"data[{index}]: target_tokens must be integers")
    weights = (_float_input(inputs, "weights", index, dims)
               if "weights" in inputs else np.ones(targets.shape, np.float32))
    extras = {field: _float_input(inputs, name, index) for field, name in PER_TOKEN_INPUTS.items() if name in inputs}
    lengths = {"input tokens": len(tokens), "target_tokens": len(targets), "weights": len(weights)}
    lengths.update({PER_TOKEN_INPUTS[field]: len(values) for field, values in extras.items()})
    if len(set(lengths.values())) != 1:
        raise UserError(f"data[{index}]: lengths disagree: " + ", ".join(f"{n} {k}" for k, n in lengths.items()))
    if weights.shape != targets.shape:
        raise UserError(f"data[{index}]: weights of shape {list(weights.shape)} for target_tokens of shape "
                        f"{list(targets.shape)}")
    if targets.ndim == 2 and targets.shape[1] == 0:
        raise UserError(f"data[{index}]: [N, K] target_tokens need K >= 1")
    if len(tokens) == 0:
        raise UserError(f"data[{index}]: empty model_input")
    if "sequence_ratio_mask" in extras and not np.any(extras["sequence_ratio_mask"] != 0):
        raise UserError(f"data[{index}]: sequence_ratio_mask marks no token (gspo's sequence ratio is a mean over "
                        "the marked tokens)")
    if loss_fn in PROVENANCE_LOSSES:
        extras.update(_provenance(msg, index, len(tokens)))
    return Datum(tokens, targets.astype(np.int64), weights, **extras)


def _provenance(msg: Any, index: int, length: int) -> dict[str, tuple[Span, ...] | None]:
    """A datum's provenance spans, each list tiling its field exactly (the SDK checks this for 1-D targets)."""
    if not msg.model_input_spans and not msg.loss_fn_input_spans:
        return {"input_spans": None, "target_spans": None}
    out: dict[str, tuple[Span, ...] | None] = {}
    for key, name in (("input_spans", "model_input_spans"), ("target_spans", "loss_fn_input_spans")):
        spans = []
        for span in getattr(msg, name):
            arm = span.WhichOneof("span")
            run = getattr(span, arm) if arm else None
            if run is None or not run.sequence_id or run.offset < 0 or run.length < 0:
                raise UserError(f"data[{index}].{name}: a span needs a sequence_id, offset >= 0 and length >= 0")
            spans.append(Span(arm == "sampled_tokens", run.sequence_id, int(run.offset), int(run.length)))
        if sum(s.length for s in spans) != length:
            raise UserError(f"data[{index}].{name} cover {sum(s.length for s in spans)} positions, not the datum's "
                            f"{length}")
        out[key] = tuple(spans)
    return out


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
    required = LOSS_CONFIG_REQUIRED.get(msg.loss_fn, frozenset())
    unknown = sorted(set(raw) - set(defaults) - required)
    if unknown:
        accepted = sorted(set(defaults) | required) or "no keys"
        raise UserError(f"loss_fn_config {unknown} is not accepted by {msg.loss_fn} (it takes {accepted})")
    missing = sorted(required - set(raw))
    if missing:
        raise UserError(f"{msg.loss_fn} needs loss_fn_config {missing}: Tinker's documentation gives no default, "
                        "so this server assumes none")
    config = {**defaults, **raw}
    if not all(np.isfinite(v) for v in config.values()):
        raise UserError("loss_fn_config values must be finite")
    if "clip_low_threshold" in config and not 0 <= config["clip_low_threshold"] <= config["clip_high_threshold"]:
        raise UserError("loss_fn_config: need 0 <= clip_low_threshold <= clip_high_threshold, got "
                        f"{config['clip_low_threshold']} and {config['clip_high_threshold']}")
    if msg.loss_fn == "stable_reinforce" and not config["clip_high_threshold"] > 0:
        raise UserError(f"loss_fn_config: need clip_high_threshold > 0, got {config['clip_high_threshold']}")
    if config.get("beta", 0.0) < 0:
        raise UserError(f"loss_fn_config: need beta >= 0, got {config['beta']}")
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
        reason = UNSUPPORTED_LOSS_REASONS.get(msg.loss_fn)
        raise UserError(f"unsupported loss function {msg.loss_fn!r}; this server supports {list(SUPPORTED_LOSS_FNS)}"
                        + (f". {reason}" if reason else ""))
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


def _runs_by_trailing_shape(result: FwdBwdResult) -> list[range]:
    """Consecutive datums whose outputs share a trailing shape (``[]`` for ``[N]``, ``[K]`` for ``[N, K]``)."""
    runs: list[range] = []
    for i, array in enumerate(result.logprobs):
        if runs and result.logprobs[runs[-1].start].shape[1:] == array.shape[1:]:
            runs[-1] = range(runs[-1].start, i + 1)
        else:
            runs.append(range(i, i + 1))
    return runs


def encode_forward_backward_output(result: FwdBwdResult) -> bytes:
    """The ``ForwardBackwardOutput`` protobuf the SDK decodes: batched ``ArrayRecord`` chunks, one per run of
    datums whose outputs have the same trailing shape (the SDK reads ``[N, K]`` outputs from ``trailing_shape``)."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.metrics["loss:sum"] = result.loss_sum
    for run in _runs_by_trailing_shape(result):
        record = out.loss_fn_outputs.add(num_datums=len(run))
        for name, arrays in (("logprobs", result.logprobs), ("elementwise_loss", result.elementwise_loss)):
            arrays32 = [np.ascontiguousarray(arrays[i], dtype=np.float32) for i in run]
            offsets = np.cumsum([0] + [a.nbytes for a in arrays32], dtype=np.int64)
            field = record.fields[name]
            field.dtype = pb.DTYPE_FLOAT32
            field.data = b"".join(a.tobytes() for a in arrays32)
            field.offsets = offsets.tobytes()
            field.trailing_shape.extend(arrays32[0].shape[1:])
    return out.SerializeToString()


def forward_backward_output_json(result: FwdBwdResult) -> dict[str, Any]:
    """The same result as JSON, for clients that do not ask for protobuf (e.g. curl)."""

    def tensor(a: np.ndarray) -> dict[str, Any]:
        return {"data": [float(x) for x in a.reshape(-1)], "dtype": "float32", "shape": list(a.shape)}

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
