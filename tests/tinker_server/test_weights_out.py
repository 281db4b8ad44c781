"""Weights out, end to end: a LoRA adapter trained through the SDK, downloaded with the SDK's own download
(``tinker checkpoint download`` and tinker-cookbook's ``weights.download``), loads in ``peft`` and in
``weights.build_hf_model``'s merged model with the server sampler's logprobs; the RestClient's run and
checkpoint listings, TTL and delete work and survive a restart.

The model is a tiny randomly initialised Qwen3 (untied unembedding, so LoRA also wraps ``lm_head``) with a chat
tokenizer (``tiny_models``, the session's ``chat_models``): a real architecture, nothing downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tinker_sdk_helpers import require

tinker = require("tinker")
peft = require("peft")
from tinker import types  # noqa: E402
from tinker_sdk_helpers import (  # noqa: E402
    API_KEY,
    NAMED_MODEL,
    RESULT_TIMEOUT_S,
    adam,
    random_data,
    start_server,
    stop_server,
    to_sdk,
    unmanaged_stage_supported,
)

from deepspeed_tinker.api import checkpoint_dir  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")
PROMPT = [72, 101, 108, 108, 111, 44, 32, 68, 101, 101, 112]
#: Logprobs of the same fp32 weights through two code paths (the server's sampler, transformers + peft
#: with another attention kernel) agree to ~1e-6; training moves them by more than 1e-2.
LOGPROB_ATOL = 1e-4


def server_distributions(sampler, vocab: int) -> np.ndarray:
    """log p(. | PROMPT[:i]) over the whole vocabulary for i = 1 .. len(PROMPT) - 1, from the server's sampler."""
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1, seed=0),
                            include_prompt_logprobs=True, topk_prompt_logprobs=vocab).result(timeout=RESULT_TIMEOUT_S)
    rows = np.full((len(PROMPT) - 1, vocab), np.nan)
    for i, top in enumerate(result.topk_prompt_logprobs[1:]):
        for token, logprob in top:
            rows[i, token] = logprob
    assert not np.isnan(rows).any()
    return rows


def local_distributions(model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([PROMPT[:-1]])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def train(training, rng: np.random.Generator, steps: int = 2) -> None:
    for _ in range(steps):
        futures = [training.forward_backward(to_sdk(random_data(rng, 3)), "cross_entropy") for _ in range(2)]
        training.optim_step(types.AdamParams(**adam(learning_rate=5e-2))).result(timeout=RESULT_TIMEOUT_S)
        for future in futures:
            future.result(timeout=RESULT_TIMEOUT_S)


def cli_download(base_url: str, tinker_path: str, output: Path) -> Path:
    """``tinker checkpoint download`` as a user runs it; the directory it creates."""
    env = {**os.environ, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": API_KEY}
    done = subprocess.run([sys.executable, "-m", "tinker.cli", "checkpoint", "download", tinker_path, "--output",
                           str(output)], env=env, cwd=output.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return output / tinker_path.replace("tinker://", "").replace("/", "_")


def wait_until(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def checkpoint_dir_of(root: Path, tinker_path: str) -> Path:
    run_id, kind, name = tinker_path[len("tinker://"):].split("/")
    return checkpoint_dir(root, run_id, name, kind)


def test_a_trained_adapter_comes_out_and_the_listings_survive_a_restart(tmp_path: Path, chat_models: dict[str, Path],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    require("tinker_cookbook")
    from tinker_cookbook import weights
    from transformers import AutoModelForCausalLM

    stages = [s for s in range(4) if unmanaged_stage_supported(s)]
    if not stages:
        pytest.skip("this DeepSpeed supports no ZeRO stage in unmanaged mode")
    stage, checkpoints = stages[-1], tmp_path / "ckpt"  # the most sharded stage: the export gathers
    base_dir = chat_models[NAMED_MODEL]
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    base = lambda: AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)  # noqa: E731
    vocab = base().config.vocab_size

    first = start_server(tmp_path / "first", stage, checkpoints, base_models=(base_dir, ))
    try:
        service = tinker.ServiceClient(base_url=first.base_url, api_key=API_KEY)
        rest = tinker.RestClient(base_url=first.base_url, api_key=API_KEY)
        training = service.create_lora_training_client(base_model=str(base_dir), rank=4, seed=5,
                                                       user_metadata={"experiment": "weights-out"}).result(timeout=120)
        run_id = training.model_id
        train(training, np.random.default_rng(3))
        short = training.save_state("short", ttl_seconds=2).result(timeout=RESULT_TIMEOUT_S).path
        final = training.save_state("final", user_metadata={"note": "kept"}).result(timeout=RESULT_TIMEOUT_S).path
        sampler_path = training.save_weights_for_sampler("final").result(timeout=RESULT_TIMEOUT_S).path
        doomed = training.save_weights_for_sampler("doomed").result(timeout=RESULT_TIMEOUT_S).path
        expected = server_distributions(service.create_sampling_client(model_path=sampler_path).result(timeout=60),
                                        vocab)
        assert np.abs(expected - local_distributions(base())).max() > 1e-2, "training barely moved the model"

        # The SDK's CLI download: a PEFT adapter, loaded by peft, is the model the server samples.
        cli_dir = cli_download(first.base_url, final, tmp_path / "cli")
        assert sorted(p.name for p in cli_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        adapted = peft.PeftModel.from_pretrained(base(), str(cli_dir))
        np.testing.assert_allclose(local_distributions(adapted), expected, atol=LOGPROB_ATOL, rtol=0)

        # tinker-cookbook's download (age-encrypted on the server, decrypted here), merge and adapter build.
        cookbook_dir = Path(weights.download(tinker_path=final, output_dir=str(tmp_path / "cookbook"),
                                             base_url=first.base_url))
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            assert (cookbook_dir / name).read_bytes() == (cli_dir / name).read_bytes(), name
        weights.build_hf_model(base_model=str(base_dir), adapter_path=str(cookbook_dir),
                               output_path=str(tmp_path / "merged"), dtype="float32")
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
        np.testing.assert_allclose(local_distributions(merged), expected, atol=LOGPROB_ATOL, rtol=0)
        weights.build_lora_adapter(base_model=str(base_dir), adapter_path=str(cookbook_dir),
                                   output_path=str(tmp_path / "peft-adapter"))
        rebuilt = peft.PeftModel.from_pretrained(base(), str(tmp_path / "peft-adapter"))
        np.testing.assert_allclose(local_distributions(rebuilt), expected, atol=LOGPROB_ATOL, rtol=0)

        # Listings: this run, its checkpoints; the downloads' temporary runs hold no export any more.
        run = rest.get_training_run(run_id).result(timeout=30)
        assert (run.base_model, run.is_lora, run.lora_rank) == (str(base_dir), True, 4)
        assert run.user_metadata == {"experiment": "weights-out"}
        assert run.last_checkpoint.tinker_path == final and run.last_sampler_checkpoint.tinker_path == doomed
        listed = {c.tinker_path: c for c in rest.list_checkpoints(run_id).result(timeout=30).checkpoints}
        assert sorted(listed) == sorted([final, sampler_path, doomed]), "short expired (ttl 2 s)"
        assert listed[final].checkpoint_type == "training" and listed[final].user_metadata == {"note": "kept"}
        assert listed[sampler_path].checkpoint_type == "sampler" and listed[final].expires_at is None
        for path, checkpoint in listed.items():
            files = [p for p in checkpoint_dir_of(checkpoints, path).rglob("*") if p.is_file()]
            assert checkpoint.size_bytes == sum(p.stat().st_size for p in files) > 0
        assert wait_until(lambda: not checkpoint_dir_of(checkpoints, short).exists()), "expired, still on disk"
        with pytest.raises(Exception, match="no checkpoint"):
            service.create_training_client_from_state(short).result(timeout=120)
        runs = rest.list_training_runs(limit=10).result(timeout=30)
        assert runs.cursor.total_count == 3, "this run, and the runs the two downloads export from"
        for other in runs.training_runs:
            if other.training_run_id != run_id:
                assert rest.list_checkpoints(other.training_run_id).result(timeout=30).checkpoints == []
        assert not list((checkpoints).glob("*/external_weights/*")), "the downloads deleted their exports"
        assert [c.tinker_path for c in rest.list_user_checkpoints().result(timeout=30).checkpoints] == [
            doomed, sampler_path, final]

        # TTL set and removed; delete.
        rest.set_checkpoint_ttl_from_tinker_path(final, 7200).result(timeout=30)
        expires = {c.tinker_path: c.expires_at for c in rest.list_checkpoints(run_id).result(timeout=30).checkpoints}
        assert 7100 < expires[final].timestamp() - time.time() <= 7200
        rest.set_checkpoint_ttl_from_tinker_path(final, None).result(timeout=30)
        rest.delete_checkpoint_from_tinker_path(doomed).result(timeout=30)
        assert not checkpoint_dir_of(checkpoints, doomed).exists()
        with pytest.raises(tinker.NotFoundError):
            rest.delete_checkpoint_from_tinker_path(doomed).result(timeout=30)
        before = rest.list_checkpoints(run_id).result(timeout=30)
        runs_before = rest.list_training_runs(limit=10).result(timeout=30)
        until_restart = training.save_state("until-restart", ttl_seconds=4).result(timeout=RESULT_TIMEOUT_S).path
        service.close("success").result(timeout=30)
    finally:
        stop_server(first)

    second = start_server(tmp_path / "second", stage, checkpoints, base_models=(base_dir, ))
    try:
        rest = tinker.RestClient(base_url=second.base_url, api_key=API_KEY)
        assert rest.list_checkpoints(run_id).result(timeout=30) == before, "until-restart expired while down"
        assert not checkpoint_dir_of(checkpoints, until_restart).exists()
        runs_after = rest.list_training_runs(limit=10).result(timeout=30)
        assert ([r.model_dump(exclude={"last_request_time"}) for r in runs_after.training_runs]
                == [r.model_dump(exclude={"last_request_time"}) for r in runs_before.training_runs])
        assert rest.get_training_run_by_tinker_path(final).result(timeout=30).user_metadata == run.user_metadata
        again = cli_download(second.base_url, final, tmp_path / "cli-again")
        name = "adapter_model.safetensors"
        assert (again / name).read_bytes() == (cli_dir / name).read_bytes(), "the same weights after the restart"
    finally:
        stop_server(second)
