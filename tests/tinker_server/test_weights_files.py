"""Weights out, in-process (no ranks): safetensors layouts that peft and transformers load, the SQLite store of
runs and checkpoints (TTL, delete, reopen), signed download URLs, and the RestClient's routes and shapes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tinker_sdk_helpers import build_tiny_hf_model, require

require("tinker")
peft = require("peft")
from http_in_process import handle  # noqa: E402
from tinker import types  # noqa: E402

from deepspeed_tinker.api import ApiSettings, TinkerApi  # noqa: E402
from deepspeed_tinker.checkpoint_files import (  # noqa: E402
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MODEL_WEIGHTS,
    read_weights,
    write_weights,
)
from deepspeed_tinker.checkpoint_store import CheckpointStore  # noqa: E402
from deepspeed_tinker.commands import COMMANDS  # noqa: E402
from deepspeed_tinker.download_urls import UrlSigner  # noqa: E402
from deepspeed_tinker.jobs import CheckpointRecord, SaveExternal  # noqa: E402
from deepspeed_tinker.model import LORA_ALPHA, LoraSpec, build_model, register_local_model  # noqa: E402
from deepspeed_tinker.scheduler import FutureStore, Scheduler  # noqa: E402
from deepspeed_tinker.worker import TrainingModel, Worker  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")
KEY = {"x-api-key": "tml-test", "host": "127.0.0.1:9"}
TOKENS = torch.tensor([[5, 17, 99, 3, 250, 42, 7]])


def perturbed(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Move every trainable weight (a fresh LoRA adapter is a no-op: B = 0), as training would."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local model (GPT-2: Conv1D layers, tied unembedding), registered as the servers do."""
    return register_local_model(build_tiny_hf_model(tmp_path_factory.mktemp("hf") / "gpt2")).name


@pytest.mark.parametrize("base", ["tiny-llama-byte", "gpt2"])
def test_a_lora_checkpoint_is_a_peft_adapter(tmp_path: Path, base: str, gpt2_dir: str) -> None:
    base = gpt2_dir if base == "gpt2" else base
    trained = build_model(base, LoraSpec(rank=4, seed=1))
    weights = perturbed(trained)
    write_weights(tmp_path / "ckpt", trained, weights, base)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]

    # PEFT's own writer is the reference for key names (without a copy of the frozen unembedding: the base has it)
    trained.save_pretrained(str(tmp_path / "by-peft"), save_embedding_layers=False)
    from safetensors.torch import load_file

    ours, theirs = (load_file(str(tmp_path / d / ADAPTER_WEIGHTS)) for d in ("ckpt", "by-peft"))
    assert sorted(ours) == sorted(theirs)
    config = json.loads((tmp_path / "ckpt" / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == base and config["r"] == 4 and config["lora_alpha"] == LORA_ALPHA == 32

    loaded = peft.PeftModel.from_pretrained(build_model(base, None), str(tmp_path / "ckpt")).eval()
    torch.testing.assert_close(logits(loaded), logits(trained.eval()), rtol=0, atol=1e-5)
    assert (logits(loaded) - logits(build_model(base, None))).abs().max() > 1e-2, "the adapter changed nothing"
    read = read_weights(tmp_path / "ckpt")
    assert sorted(read) == sorted(weights) and all(torch.equal(read[k], weights[k]) for k in weights)


#: What rank 0 would record after an export (not used by the worker).
CHECKPOINT = CheckpointRecord("m", "external_weights/x", "", None, None)


def _worker_with(model: TrainingModel) -> Worker:
    """A worker of one rank holding ``model`` as model ``m`` (its engine stands in: the export reads its module)."""
    worker = Worker(0, 1, 0)
    worker.models["m"] = model
    return worker


def test_a_full_checkpoint_is_a_transformers_model_with_its_tokenizer(tmp_path: Path, gpt2_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = build_model(gpt2_dir, None)
    weights = perturbed(trained)
    reply = _worker_with(TrainingModel(SimpleNamespace(module=trained))).save_external("m", SaveExternal(
        str(tmp_path / "export"), gpt2_dir, gpt2_dir, None, {"path": "p"}, CHECKPOINT))
    assert reply == {"path": "p"} and (tmp_path / "export" / MODEL_WEIGHTS).is_file()
    assert not list(tmp_path.glob(".*.tmp")), "the staging directory was swapped in"
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    torch.testing.assert_close(logits(loaded), logits(trained.eval()), rtol=0, atol=1e-5)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "export")).decode([104, 105]) == "hi"
    assert sorted(read_weights(tmp_path / "export")) == sorted(weights)


def test_an_encrypted_export_decrypts_to_the_same_files(tmp_path: Path) -> None:
    pyrage = require("pyrage")
    identity = pyrage.x25519.Identity.generate()
    trained = build_model("tiny-llama-byte", LoraSpec(rank=2, seed=3))
    perturbed(trained)
    for name, recipients in (("plain", None), ("sealed", [str(identity.to_public())])):
        worker = _worker_with(TrainingModel(SimpleNamespace(module=trained), lora=LoraSpec(2, 3)))
        worker.save_external("m", SaveExternal(str(tmp_path / name), "tiny-llama-byte", None,
                                               tuple(recipients) if recipients else None, {}, CHECKPOINT))
    sealed = sorted(p.name for p in (tmp_path / "sealed").iterdir())
    assert sealed == [ADAPTER_CONFIG + ".age", ADAPTER_WEIGHTS + ".age"]
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        pyrage.decrypt_file(str(tmp_path / "sealed" / f"{name}.age"), str(tmp_path / name), [identity])
        assert (tmp_path / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_the_store_keeps_runs_and_checkpoints_with_ttls_across_a_reopen(tmp_path: Path) -> None:
    clock = Clock()
    store = CheckpointStore(tmp_path, clock)
    store.add_run("r1", "tiny-llama-byte", {"rank": 4, "seed": 1}, {"who": "me", "n": 3})
    dirs = {name: tmp_path / name for name in ("a", "b", "c")}
    for directory in dirs.values():
        directory.mkdir()
    store.add_checkpoint("r1", "weights/a", dirs["a"], 10)
    clock.now += 1
    store.add_checkpoint("r1", "sampler_weights/b", dirs["b"], 20, ttl_seconds=5, user_metadata={"k": "v"})
    clock.now += 1
    store.add_checkpoint("r1", "external_weights/c", dirs["c"], 30, ttl_seconds=100)
    store.close()

    store = CheckpointStore(tmp_path, clock)  # a restart
    run = types.TrainingRun.model_validate(store.run_json("r1"))
    assert (run.is_lora, run.lora_rank, run.user_metadata) == (True, 4, {"who": "me", "n": "3"})
    assert run.last_checkpoint.checkpoint_id == "weights/a"
    assert run.last_sampler_checkpoint.checkpoint_id == "sampler_weights/b"
    listed = [row.checkpoint_id for row in store.checkpoints("r1")]
    assert listed == ["external_weights/c", "sampler_weights/b", "weights/a"], "newest first"
    assert store.checkpoint("r1", "sampler_weights/b").user_metadata == {"k": "v"}

    assert store.set_ttl("r1", "weights/a", 3) and not store.set_ttl("r1", "weights/zzz", 3)
    assert store.set_ttl("r1", "sampler_weights/b", None), "None removes the expiry"
    clock.now += 4
    assert store.checkpoint("r1", "weights/a") is None, "expired: hidden before it is reaped"
    assert dirs["a"].is_dir()
    assert store.reap() == ["tinker://r1/weights/a"] and not dirs["a"].exists()
    assert [row.checkpoint_id for row in store.checkpoints("r1")] == ["external_weights/c", "sampler_weights/b"]
    assert store.delete("r1", "external_weights/c") and not dirs["c"].exists()
    assert not store.delete("r1", "external_weights/c")
    clock.now += 10**6
    assert store.reap() == [] and dirs["b"].is_dir(), "no TTL, no expiry"


def test_signed_urls_cannot_be_forged_or_reused_after_expiry() -> None:
    clock = Clock()
    signer = UrlSigner(b"k" * 32, clock)
    url = signer.sign("http://h:1", "r1", "external_weights/x", "adapter_model.safetensors", clock.now + 60)
    token = url.split("/files/", 1)[1]
    assert signer.verify(token).file == "adapter_model.safetensors"
    payload, signature = token.split(".")
    assert signer.verify(f"{payload}.{signature[:-2]}AA") is None
    assert UrlSigner(b"x" * 32, clock).verify(token) is None, "another server's key"
    clock.now += 61
    assert signer.verify(token) is None


def request(api: TinkerApi, method: str, route: str, body: dict | None = None, headers: dict | None = None):
    response = handle(api, method, route if route.startswith("/") else f"/api/v1/{route}", headers or KEY,
                      json.dumps(body).encode() if body is not None else b"")
    return response.status, response


def test_the_rest_routes_answer_in_the_sdks_shapes(tmp_path: Path) -> None:
    api = TinkerApi(Scheduler(FutureStore()), ApiSettings(tmp_path, long_poll_s=0.05))
    session = json.loads(request(api, "POST", "create_session", {})[1].body)["session_id"]
    created = json.loads(request(api, "POST", "create_model", {
        "session_id": session, "model_seq_id": 0, "base_model": "tiny-llama-byte", "lora_config": {"rank": 4},
        "user_metadata": {"owner": "test"}})[1].body)
    run_id = created["model_id"]
    job = api.scheduler.next_job(timeout=0)
    assert request(api, "GET", f"training_runs/{run_id}")[0] == 404, "listed once created on the ranks"
    COMMANDS[job.kind].record(api, job.payload)  # as rank 0 does once the ranks succeeded

    reply = request(api, "POST", "save_weights_external", {"model_id": run_id, "seq_id": 1, "path": "out",
                                                           "ttl_seconds": 3600})
    job = api.scheduler.next_job(timeout=0)
    directory = Path(job.payload.dir)  # what the ranks would write
    directory.mkdir(parents=True)
    (directory / ADAPTER_WEIGHTS).write_bytes(b"w" * 100)
    (directory / ADAPTER_CONFIG).write_text("{}")
    COMMANDS[job.kind].record(api, job.payload)  # as rank 0 does once the ranks succeeded
    assert reply[0] == 200

    run = types.TrainingRun.model_validate_json(request(api, "GET", f"training_runs/{run_id}")[1].body)
    assert run.training_run_id == run_id and run.user_metadata == {"owner": "test"} and run.lora_rank == 4
    runs = types.TrainingRunsResponse.model_validate_json(request(api, "GET", "training_runs?limit=5")[1].body)
    assert [r.training_run_id for r in runs.training_runs] == [run_id] and runs.cursor.total_count == 1
    listing = types.CheckpointsListResponse.model_validate_json(
        request(api, "GET", f"training_runs/{run_id}/checkpoints")[1].body)
    (checkpoint, ) = listing.checkpoints
    assert checkpoint.tinker_path == f"tinker://{run_id}/external_weights/out" and checkpoint.size_bytes == 102
    assert checkpoint.checkpoint_type == "external" and checkpoint.expires_at is not None
    everything = types.CheckpointsListResponse.model_validate_json(request(api, "GET", "checkpoints")[1].body)
    assert [c.tinker_path for c in everything.checkpoints] == [checkpoint.tinker_path]
    info = types.WeightsInfoResponse.model_validate_json(
        request(api, "POST", "weights_info", {"tinker_path": checkpoint.tinker_path})[1].body)
    assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny-llama-byte", True, 4)

    urls = types.ExternalWeightsUrlsResponse.model_validate_json(
        request(api, "GET", f"training_runs/{run_id}/checkpoints/external_weights/out/external_weights_urls")[1].body)
    assert sorted(urls.urls) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    file_url = urls.urls[ADAPTER_WEIGHTS]
    assert file_url.startswith("http://127.0.0.1:9/files/")
    status, response = request(api, "GET", file_url[len("http://127.0.0.1:9"):], headers={})  # no API key needed
    assert status == 200 and response.body == b"w" * 100
    assert request(api, "GET", file_url[len("http://127.0.0.1:9"):] + "x", headers={})[0] == 403

    route = f"training_runs/{run_id}/checkpoints/external_weights/out"
    assert request(api, "PUT", f"{route}/ttl", {"ttl_seconds": 0})[0] == 400
    assert request(api, "PUT", f"{route}/ttl", {"ttl_seconds": None})[0] == 200
    assert api.store.checkpoint(run_id, "external_weights/out").expires_at is None
    assert request(api, "DELETE", route)[0] == 200 and not directory.exists()
    assert request(api, "DELETE", route)[0] == 404
    assert request(api, "GET", file_url[len("http://127.0.0.1:9"):], headers={})[0] == 404, "deleted: no download"
    assert request(api, "GET", "training_runs/nope/checkpoints")[0] == 404

    bad = {"model_id": run_id, "seq_id": 2, "path": "x", "age_encryption_recipients": ["not-a-key"]}
    failure = json.loads(request(api, "POST", "retrieve_future", {
        "request_id": json.loads(request(api, "POST", "save_weights_external", bad)[1].body)["request_id"]})[1].body)
    assert failure["category"] == "user" and "age recipient" in failure["error"]
    ttl = {"model_id": run_id, "seq_id": 3, "path": "x", "ttl_seconds": -5}
    failure = json.loads(request(api, "POST", "retrieve_future", {
        "request_id": json.loads(request(api, "POST", "save_weights", ttl)[1].body)["request_id"]})[1].body)
    assert failure["category"] == "user" and "ttl_seconds" in failure["error"]
