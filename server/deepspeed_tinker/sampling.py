"""Sampling requests and results on the wire: validation and the ``SampleResponse`` protobuf.

Pure data handling (numpy, no torch), like ``wire``. Everything a client can get wrong is found
here, before any rank runs, and reported as a ``user`` error: an empty prompt, token ids outside
the vocabulary, ``max_tokens`` past the context, a negative temperature, bad top-k/top-p, features
this server does not implement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import UserError
from .wire import _pb

#: Most samples one request may ask for.
MAX_NUM_SAMPLES = 256
#: Unnamed sampler snapshots (``save_weights_and_get_sampling_client``) each rank keeps in memory, at most
#: (``--sampler-snapshots``), and their bytes at most (``--sampler-snapshot-mib``; the newest is always kept).
MAX_SNAPSHOTS = 8
DEFAULT_SNAPSHOT_BYTES = 4 << 30


@dataclass(frozen=True)
class SnapshotRef:
    """Which weights a sampler runs: an in-memory snapshot, a file saved for sampling, or the base model."""

    snapshot_id: str
    base_model: str
    lora: dict[str, Any] | None = None
    #: A file to load the weights from when no rank holds ``snapshot_id`` (saved sampler weights).
    file: str | None = None
    #: Why this reference cannot be sampled (an unknown path); reported when a sample asks for it.
    error: str | None = None


@dataclass(frozen=True)
class SampleJob:
    """One validated ``asample`` request; ``seeds`` holds one seed per sample, so every rank
    draws the same sequence for sample ``i`` whichever rank runs it."""

    snapshot: SnapshotRef
    prompt: tuple[int, ...]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop_tokens: tuple[int, ...]
    stop_strings: tuple[str, ...]
    seeds: tuple[int, ...]
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0


@dataclass(frozen=True)
class SampledSequence:
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32, the model's (untempered) logprob of each sampled token
    stop_reason: str  # "stop" | "length"
    topk_ids: np.ndarray | None = None  # int32 [n, k]
    topk_logprobs: np.ndarray | None = None  # float32 [n, k]


@dataclass(frozen=True)
class SampleResult:
    sequences: tuple[SampledSequence, ...]
    prompt_logprobs: np.ndarray | None = None  # float32 [len(prompt)], NaN where not computed
    topk_prompt_ids: np.ndarray | None = None
    topk_prompt_logprobs: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def prompt_tokens(prompt: Any) -> tuple[int, ...]:
    """The token ids of a JSON ``ModelInput`` (text chunks only)."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise UserError("prompt must be a ModelInput with chunks")
    tokens: list[int] = []
    for chunk in prompt["chunks"]:
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise UserError(f"prompt: only encoded_text chunks are supported, got {kind}")
        values = chunk.get("tokens")
        if not isinstance(values, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
            raise UserError("prompt: encoded_text tokens must be a list of integers")
        tokens += values
    return tuple(tokens)


def _number(params: dict[str, Any], name: str, default: float) -> float:
    value = params.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"sampling_params.{name} must be a finite number, got {value!r}")
    return float(value)


def _stops(stop: Any, default_tokens: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``None`` keeps the model's EOS; ``[]`` disables stopping; strings stop on any of them or on the EOS (a chat
    renderer that stops on a string still ends at EOS); token ids stop on exactly those tokens."""
    if stop is None:
        return default_tokens, ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise UserError("sampling_params.stop must be a string, a list of strings or a list of token ids, "
                        f"got {stop!r}")
    if all(isinstance(s, str) for s in stop):
        if any(s == "" for s in stop):
            raise UserError("sampling_params.stop: empty stop string")
        return (default_tokens if stop else ()), tuple(stop)
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        return tuple(stop), ()
    raise UserError("sampling_params.stop must not mix strings and token ids")


def parse_sample(body: dict[str, Any], snapshot: SnapshotRef, vocab_size: int, max_context_length: int,
                 eos_token_ids: tuple[int, ...], fallback_seed: int) -> SampleJob:
    """Validate an ``asample`` body against the model it samples; without a seed in the request the
    per-sample seeds derive from ``fallback_seed`` (drawn by the server)."""
    if snapshot.error:
        raise UserError(snapshot.error)
    prompt = prompt_tokens(body.get("prompt"))
    if not prompt:
        raise UserError("empty prompt: sampling needs at least one prompt token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"prompt has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    num_samples = body.get("num_samples", 1)
    if not isinstance(num_samples, int) or not 1 <= num_samples <= MAX_NUM_SAMPLES:
        raise UserError(f"num_samples must be an integer in [1, {MAX_NUM_SAMPLES}], got {num_samples!r}")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise UserError("sampling_params must be an object")
    room = max_context_length - len(prompt)
    if room < 1:
        raise UserError(f"the prompt's {len(prompt)} tokens leave no room in the context length {max_context_length}")
    max_tokens = params.get("max_tokens")
    if max_tokens is None:
        max_tokens = room
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise UserError(f"sampling_params.max_tokens must be an integer >= 1, got {max_tokens!r}")
    if len(prompt) + max_tokens > max_context_length:
        raise UserError(f"max_tokens {max_tokens} with a {len(prompt)}-token prompt exceeds the context length "
                        f"{max_context_length}")
    temperature = _number(params, "temperature", 1.0)
    if temperature < 0:
        raise UserError(f"sampling_params.temperature must be >= 0, got {temperature}")
    top_k = params.get("top_k", -1)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or (top_k < 1 and top_k not in (-1, 0)):
        raise UserError(f"sampling_params.top_k must be -1 (no limit) or a positive integer, got {top_k!r}")
    top_p = _number(params, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise UserError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    stop_tokens, stop_strings = _stops(params.get("stop"), eos_token_ids)
    seed = params.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise UserError(f"sampling_params.seed must be a non-negative integer, got {seed!r}")
    base = np.random.default_rng(seed if seed is not None else fallback_seed)
    seeds = tuple(int(s) for s in base.integers(0, 2**62, num_samples))
    for unsupported in ("target_prompt_logprobs", "prompt_alt_tokens_k"):
        if body.get(unsupported):
            raise UserError(f"{unsupported} is not supported by this server")
    last_n = body.get("prompt_logprobs_last_n")
    want_prompt = bool(body.get("prompt_logprobs"))
    if last_n is not None and (not isinstance(last_n, int) or not 1 <= last_n <= len(prompt) - 1):
        raise UserError(f"prompt_logprobs_last_n must be in [1, {len(prompt) - 1}], got {last_n!r}")
    topk_prompt = int(body.get("topk_prompt_logprobs") or 0)
    topk_sample = int(body.get("topk_sample_logprobs") or 0)
    if not (0 <= topk_prompt <= vocab_size and 0 <= topk_sample <= vocab_size):
        raise UserError("topk_prompt_logprobs and topk_sample_logprobs must be in [0, vocab size]")
    return SampleJob(snapshot, prompt, num_samples, max_tokens, temperature, top_k if top_k > 0 else -1, top_p,
                     stop_tokens, stop_strings, seeds, want_prompt or topk_prompt > 0, last_n, topk_prompt,
                     topk_sample)


def _topk(pb: Any, ids: np.ndarray, logprobs: np.ndarray) -> Any:
    return pb.TopkLogprobs(token_ids=np.ascontiguousarray(ids, np.int32).tobytes(),
                           logprobs=np.ascontiguousarray(logprobs, np.float32).tobytes(), k=ids.shape[1],
                           length=ids.shape[0])


def encode_sample_response(result: SampleResult) -> bytes:
    """The ``SampleResponse`` protobuf (the SDK accepts sampling results only in this form)."""
    pb = _pb()
    out = pb.SampleResponse()
    for sequence in result.sequences:
        entry = out.sequences.add()
        entry.stop_reason = pb.STOP_REASON_STOP if sequence.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        entry.tokens = np.ascontiguousarray(sequence.tokens, np.int32).tobytes()
        entry.logprobs = np.ascontiguousarray(sequence.logprobs, np.float32).tobytes()
        if sequence.topk_ids is not None:
            entry.topk_sampled_logprobs.CopyFrom(_topk(pb, sequence.topk_ids, sequence.topk_logprobs))
    if result.prompt_logprobs is not None:
        out.prompt_logprobs = np.ascontiguousarray(result.prompt_logprobs, np.float32).tobytes()
    if result.topk_prompt_ids is not None:
        out.topk_prompt_logprobs.CopyFrom(_topk(pb, result.topk_prompt_ids, result.topk_prompt_logprobs))
    return out.SerializeToString()


def sample_response_json(result: SampleResult) -> dict[str, Any]:
    """The same result as JSON, for clients other than the SDK (e.g. curl)."""

    def floats(a: np.ndarray) -> list[float | None]:
        return [None if math.isnan(x) else float(x) for x in a.tolist()]

    return {
        "type": "sample",
        "sequences": [{"tokens": s.tokens.tolist(), "logprobs": floats(s.logprobs), "stop_reason": s.stop_reason}
                      for s in result.sequences],
        "prompt_logprobs": None if result.prompt_logprobs is None else floats(result.prompt_logprobs),
    }


def merge_samples(parts: list[dict[str, Any]]) -> SampleResult:
    """Rank 0: every rank's share in rank order (so sample ``i`` stays at index ``i``)."""
    sequences = tuple(s for part in parts for s in part["sequences"])
    prompt = next((part["prompt"] for part in parts if "prompt" in part), None)
    return SampleResult(sequences, None if prompt is None else prompt["logprobs"],
                        None if prompt is None else prompt.get("topk_ids"),
                        None if prompt is None else prompt.get("topk_logprobs"))
