"""``--base-model NAME=PATH``: a local model served under the Hugging Face name tinker-cookbook looks up.

In-process for the protocol (no ranks) and the cookbook's lookups; through the SDK against the session's
ZeRO-1 server (which serves a tiny Qwen3 with a chat tokenizer under its path and as ``NAMED_MODEL``) for the rest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from tinker_sdk_helpers import NAMED_MODEL, require

tinker = require("tinker")
require("transformers")
from http_in_process import handle  # noqa: E402
from tinker import types  # noqa: E402
from tinker_sdk_helpers import API_KEY, RESULT_TIMEOUT_S, adam  # noqa: E402

from deepspeed_tinker.api import ApiSettings, TinkerApi  # noqa: E402
from deepspeed_tinker.model import BASE_MODELS, build_model, parse_base_model, register_local_model  # noqa: E402
from deepspeed_tinker.scheduler import FutureStore, Scheduler  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")
KEY = {"x-api-key": "tml-test"}


@pytest.fixture
def served_models() -> Iterator[dict]:
    """The global model table, restored after the test (registering adds to it)."""
    saved = dict(BASE_MODELS)
    yield BASE_MODELS
    BASE_MODELS.clear()
    BASE_MODELS.update(saved)


def test_base_model_values_are_a_path_or_name_equals_path(tmp_path: Path) -> None:
    assert parse_base_model("Qwen/Qwen3-8B=/models/q") == ("Qwen/Qwen3-8B", "/models/q")
    assert parse_base_model("/models/q") == (None, "/models/q")
    odd = tmp_path / "a=b"
    odd.mkdir()
    assert parse_base_model(str(odd)) == (None, str(odd)), "an existing directory is a path, '=' or not"
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_base_model("=/models/q")


def test_a_named_model_is_served_under_its_name(local_hf_model: Path, served_models: dict, tmp_path: Path) -> None:
    spec = register_local_model(f"{NAMED_MODEL}={local_hf_model}")
    assert (spec.name, spec.path) == (NAMED_MODEL, str(local_hf_model))
    assert register_local_model(f"{NAMED_MODEL}={local_hf_model}") == spec, "registering again is harmless"
    with pytest.raises(ValueError, match="already served"):
        register_local_model(f"tiny-llama-byte={local_hf_model}")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((local_hf_model / "config.json").read_text())
    with pytest.raises(ValueError, match="already served"):
        register_local_model(f"{NAMED_MODEL}={other}")
    with pytest.raises(ValueError, match="no config.json"):
        register_local_model(f"Qwen/Qwen3-4B={tmp_path}")

    api = TinkerApi(Scheduler(FutureStore()), ApiSettings(tmp_path, long_poll_s=0.05))

    def post(route: str, body: dict) -> dict:
        response = handle(api, "POST", f"/api/v1/{route}", KEY, json.dumps(body).encode())
        return json.loads(response.body)

    capabilities = json.loads(handle(api, "GET", "/api/v1/get_server_capabilities", KEY, b"").body)
    names = [m["model_name"] for m in capabilities["supported_models"]]
    assert NAMED_MODEL in names and "tiny-llama-byte" in names
    session = post("create_session", {})["session_id"]
    model_id = post("create_model", {"session_id": session, "model_seq_id": 0, "base_model": NAMED_MODEL,
                                     "lora_config": {"rank": 2}})["model_id"]
    job = api.scheduler.next_job(timeout=0)
    assert job.kind == "create" and job.payload.base_model == NAMED_MODEL
    info = post("get_info", {"model_id": model_id})
    assert info["model_name"] == info["model_data"]["model_name"] == NAMED_MODEL
    assert info["model_data"]["tokenizer_id"] == str(local_hf_model), "the SDK's get_tokenizer loads it offline"
    assert info["model_data"]["arch"] == "gpt2"

    register_local_model(local_hf_model)
    named, by_path = build_model(NAMED_MODEL, None), build_model(str(local_hf_model), None)
    for (name, a), (_, b) in zip(named.state_dict().items(), by_path.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_cookbook_resolves_the_name_offline(chat_models: dict[str, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Renderer, learning rate and model info come from the cookbook's tables; the tokenizer, offline, from a
    directory of that name under the working directory (transformers loads a local path before the hub), and the
    renderer renders a conversation with it."""
    pytest.importorskip("tinker_cookbook.model_info", reason="install requirements/tinker-cookbook.txt (--no-deps)")
    from tinker_cookbook import hyperparam_utils, model_info, tokenizer_utils

    assert model_info.get_model_attributes(NAMED_MODEL).organization == "Qwen"
    assert model_info.get_recommended_renderer_name(NAMED_MODEL) == "qwen3"
    assert hyperparam_utils.get_lr(NAMED_MODEL) > 0
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    org, name = NAMED_MODEL.split("/")
    (tmp_path / org).mkdir()
    os.symlink(chat_models[NAMED_MODEL], tmp_path / org / name)
    tokenizer = tokenizer_utils.get_tokenizer(NAMED_MODEL)
    assert tokenizer.encode("hi", add_special_tokens=False) == list(b"hi")
    from tinker_cookbook import renderers

    renderer = renderers.get_renderer("qwen3", tokenizer)
    prompt = renderer.build_generation_prompt([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(prompt.to_ints()) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_sdk_trains_and_samples_a_named_model(server) -> None:
    if server.zero_stage != 1:
        pytest.skip("one stage is enough: the name only changes how the model is looked up")
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    try:
        rest = tinker.RestClient(base_url=server.base_url, api_key=API_KEY)
        capabilities = rest.get_server_capabilities().result(timeout=RESULT_TIMEOUT_S)
        names = [m.model_name for m in capabilities.supported_models]
        path = str(server.chat_models[NAMED_MODEL])
        assert {NAMED_MODEL, path, *server.chat_models, "tiny-llama-byte"} <= set(names)
        named, by_path = (service.create_lora_training_client(base_model=name, rank=4, seed=3)
                          .result(timeout=RESULT_TIMEOUT_S) for name in (NAMED_MODEL, path))
        assert named.get_info().model_data.model_name == NAMED_MODEL
        assert named.get_tokenizer().encode("hi", add_special_tokens=False) == list(b"hi")

        ids = list(b"named models train")
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:]})
        same = [c.forward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S).loss_fn_outputs[0]["logprobs"]
                for c in (named, by_path)]
        np.testing.assert_array_equal(same[0].to_numpy(), same[1].to_numpy())  # the name loads the path's weights

        named.forward_backward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
        named.optim_step(types.AdamParams(**adam(learning_rate=1e-2))).result(timeout=RESULT_TIMEOUT_S)
        samplers = (named.save_weights_and_get_sampling_client(),
                    service.create_sampling_client(base_model=NAMED_MODEL))
        for client in (future.result(timeout=RESULT_TIMEOUT_S) for future in samplers):
            result = client.sample(types.ModelInput.from_ints(list(b"hi")), 2,
                                   types.SamplingParams(max_tokens=4, seed=1)).result(timeout=RESULT_TIMEOUT_S)
            assert [len(s.tokens) for s in result.sequences] == [4, 4]
    finally:
        service.close("success").result(timeout=30)
