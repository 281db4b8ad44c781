"""Sampling's protocol layer in-process: request validation, sessions, idempotency, the response
protobuf as the SDK decodes it (no ranks, no DeepSpeed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tinker_sdk_helpers import require

require("tinker")
from http_in_process import handle  # noqa: E402
from tinker.proto.response_conv import deserialize_sample_response  # noqa: E402

from deepspeed_tinker.api import ApiSettings, TinkerApi  # noqa: E402
from deepspeed_tinker.sampling import SampledSequence, SampleResult, SnapshotRef, encode_sample_response, parse_sample  # noqa: E402
from deepspeed_tinker.scheduler import FutureStore, Scheduler  # noqa: E402
from deepspeed_tinker.wire import UserError  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")
KEY = {"x-api-key": "tml-test"}
BASE = SnapshotRef("base:tiny-llama-byte", "tiny-llama-byte")


def body(tokens: list[int], **params) -> dict:
    return {"prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]}, "num_samples": 2,
            "sampling_params": params}


def parse(request: dict, eos: tuple[int, ...] = (), seed: int = 0):
    return parse_sample(request, BASE, 256, 32, eos, seed)


def test_sampling_params_get_tinker_defaults() -> None:
    job = parse(body([1, 2, 3]), eos=(7, ))
    assert job.prompt == (1, 2, 3) and job.num_samples == 2
    assert job.max_tokens == 29, "no max_tokens: the rest of the context"
    assert (job.temperature, job.top_k, job.top_p) == (1.0, -1, 1.0)
    assert job.stop_tokens == (7, ) and job.stop_strings == (), "stop=None keeps the model's EOS"
    assert parse(body([1], stop=[]), eos=(7, )).stop_tokens == (), "stop=[] disables even EOS"
    strings = parse(body([1], stop="\n\n"), eos=(7, ))
    assert strings.stop_strings == ("\n\n", ) and strings.stop_tokens == (7, ), "stop strings keep the EOS too"
    assert parse(body([1], stop=[3, 4])).stop_tokens == (3, 4)
    seeded = [parse(body([1], seed=5), seed=s).seeds for s in (1, 2)]
    assert seeded[0] == seeded[1] and len(set(seeded[0])) == 2, "one seed per sample, fixed by the request's seed"
    assert parse(body([1]), seed=1).seeds != parse(body([1]), seed=2).seeds


@pytest.mark.parametrize("request_body, message", [
    (body([]), "empty prompt"),
    (body([1, 2], max_tokens=31), "exceeds the context length"),
    (body([1] * 32), "no room"),
    (body([1], max_tokens=0), "max_tokens must be an integer >= 1"),
    (body([1], temperature=-1.0), "temperature must be >= 0"),
    (body([1], top_p=1.5), "top_p must be in"),
    (body([1], top_k=-3), "top_k must be"),
    (body([1], seed=-1), "seed must be"),
    (body([1], stop=["a", 3]), "must not mix"),
    (body([256]), "outside the vocabulary"),
    ({**body([1]), "num_samples": 0}, "num_samples"),
    ({**body([1, 2]), "prompt_logprobs": True, "prompt_logprobs_last_n": 5}, "prompt_logprobs_last_n"),
    ({**body([1]), "prompt_alt_tokens_k": 2}, "not supported"),
    ({"prompt": {"chunks": [{"type": "image", "data": ""}]}, "sampling_params": {}}, "only encoded_text"),
])
def test_bad_sampling_requests_are_user_errors(request_body: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        parse(request_body)


def test_the_response_protobuf_decodes_in_the_sdk() -> None:
    result = SampleResult(
        (SampledSequence(np.array([5, 6], np.int32), np.array([-0.5, -1.5], np.float32), "stop",
                         np.array([[5, 1], [6, 2]], np.int32), np.array([[-0.5, -2.0], [-1.5, -3.0]], np.float32)),
         SampledSequence(np.array([7, 8, 9], np.int32), np.array([-1.0, -2.0, -3.0], np.float32), "length")),
        np.array([np.nan, -2.5, -0.25], np.float32))
    decoded = deserialize_sample_response(encode_sample_response(result))
    assert [s.tokens for s in decoded.sequences] == [[5, 6], [7, 8, 9]]
    assert [s.stop_reason for s in decoded.sequences] == ["stop", "length"]
    assert decoded.sequences[1].logprobs == [-1.0, -2.0, -3.0]
    assert decoded.sequences[0].topk_logprobs == [[(5, -0.5), (1, -2.0)], [(6, -1.5), (2, -3.0)]]
    assert decoded.prompt_logprobs == [None, -2.5, -0.25]


def post(api: TinkerApi, route: str, payload: dict):
    response = handle(api, "POST", f"/api/v1/{route}", dict(KEY), json.dumps(payload).encode())
    return response.status, json.loads(response.body)


def test_sampling_sessions_and_retried_samples(tmp_path: Path) -> None:
    api = TinkerApi(Scheduler(FutureStore()), ApiSettings(tmp_path, long_poll_s=0.05))
    session = post(api, "create_session", {})[1]["session_id"]
    created = post(api, "create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                    "base_model": "tiny-llama-byte"})[1]
    sampler_id = created["sampling_session_id"]
    got = handle(api, "GET", f"/api/v1/samplers/{sampler_id}", dict(KEY), b"")
    assert json.loads(got.body) == {"sampler_id": sampler_id, "base_model": "tiny-llama-byte", "model_path": None}

    request = {**body([1, 2], max_tokens=3), "sampling_session_id": sampler_id, "seq_id": 1}
    status, first = post(api, "asample", request)
    assert status == 200 and len(first["sample_sequence_ids"]) == 2
    assert post(api, "asample", request)[1] == first, "a retried (session, seq_id) is the same sample"
    assert post(api, "asample", {**request, "seq_id": 2})[1]["request_id"] != first["request_id"]
    other_key = handle(api, "POST", "/api/v1/asample", {"x-api-key": "tml-other"}, json.dumps(request).encode())
    assert json.loads(other_key.body)["request_id"] != first["request_id"], "replies are kept per API key"
    job = api.scheduler.next_job(timeout=0)
    assert (job.kind, job.payload.max_tokens, job.payload.snapshot) == ("sample", 3, BASE)

    missing = post(api, "create_sampling_session", {"session_id": session, "sampling_session_seq_id": 1,
                                                    "model_path": "tinker://nope/sampler_weights/x"})[1]
    failed = post(api, "asample", {**body([1]), "sampling_session_id": missing["sampling_session_id"],
                                   "seq_id": 1})[1]
    reply = post(api, "retrieve_future", {"request_id": failed["request_id"]})[1]
    assert reply["category"] == "user" and "unknown sampler path" in reply["error"]
    capabilities = json.loads(handle(api, "GET", "/api/v1/get_server_capabilities", dict(KEY), b"").body)
    assert all(m["sampleable"] for m in capabilities["supported_models"])
