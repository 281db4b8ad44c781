"""Real architectures on real ranks: bf16, gradient checkpointing, ZeRO-3 sharded loading and one shared base model.

Each case runs ``worker_ranks.py`` on 2 gloo CPU ranks (the server's own ``Worker``, real DeepSpeed engines in
unmanaged mode, nothing mocked) on a tiny randomly initialised Qwen3 saved with ``save_pretrained``, wide
enough (256, MLP 512) that ZeRO-3 does not keep its matrices whole as persistent parameters.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from tinker_sdk_helpers import require, run_rank_script, unmanaged_stage_supported

SCRIPT = Path(__file__).with_name("worker_ranks.py")
WORLD = 2

pytestmark = pytest.mark.pr("zero-0-1")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("transformers")
    require("peft")
    from deepspeed_tinker.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("real") / "qwen3", "qwen3", hidden_size=256, layers=2)


def run_ranks(tmp_path: Path, zero_stage: int, dtype: str, model_dir: Path) -> list[dict]:
    return run_rank_script(SCRIPT, [str(zero_stage), dtype, str(model_dir)], tmp_path, WORLD)


def close(a, b, atol: float) -> bool:
    return bool(np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=0, atol=atol))


@pytest.mark.parametrize("zero_stage,dtype", [(1, "bf16"), (3, "bf16")], ids=["zero1-bf16", "zero3-bf16"])
def test_dtype_checkpointing_sharding_and_shared_base(tmp_path: Path, qwen3_dir: Path, zero_stage: int,
                                                      dtype: str) -> None:
    if not unmanaged_stage_supported(zero_stage):
        pytest.skip(f"this DeepSpeed does not support unmanaged mode with ZeRO stage {zero_stage}")
    reports = run_ranks(tmp_path, zero_stage, dtype, qwen3_dir)
    first = reports[0]
    torch_dtype = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}[dtype]

    # dtype: every parameter of every engine's module, base and adapters
    for model_id, dtypes in first["dtypes"].items():
        assert dtypes == [torch_dtype], (model_id, dtypes)
    assert first["bf16_enabled"] is (dtype == "bf16")

    # the checkpoint loaded as it is on disk (sharded under ZeRO-3, gathered back here)
    assert first["loaded_equals_checkpoint"] and first["loaded_names"]

    # gradient checkpointing: on where asked, layer 0's attention recomputed in backward, the same numbers
    assert first["checkpointing_flags"] == {"full": False, "full-ckpt": True, "lora": False, "lora-ckpt": True}
    tolerance = 1e-6  # the recompute is the same computation: bit-identical here, a rounding's room allowed
    for report in reports:
        steps = report["steps"]
        for plain, ckpt in (("full", "full-ckpt"), ("lora", "lora-ckpt")):
            assert steps[plain]["layer0_attention_calls"] == 1 and steps[ckpt]["layer0_attention_calls"] == 2
            for key in ("logprobs", "losses"):
                for x, y in zip(steps[plain][key], steps[ckpt][key]):
                    assert close(x, y, tolerance), (plain, key)
            # the weights after one AdamW step from the same start: the gradients agreed
            assert sorted(steps[plain]["weights"]) == sorted(steps[ckpt]["weights"])
            for name in steps[plain]["weights"]:
                assert close(steps[plain]["weights"][name], steps[ckpt]["weights"][name], tolerance), (plain, name)
        assert report["other_lora_unchanged"], "a step of one LoRA client changed another's outputs"

    # one base model for the LoRA clients: the same tensors, not a copy; full fine-tuning has its own
    for report in reports:
        shared = report["shared_base"]
        assert shared["names"] > 0 and shared["same_names"] and shared["same_objects"] and shared["same_storage"]
        assert not shared["full_ft_shares"]

    if zero_stage == 3:  # each rank holds its partition only, right after loading
        for report in reports:
            sharding = report["sharding"]
            big = [p for p in sharding["params"] if p["ds_numel"] > sharding["threshold"]]
            assert big, "the test model needs parameters above the persistence threshold"
            for p in sharding["params"]:
                assert p["partition"] == math.ceil(p["ds_numel"] / WORLD), p
            for p in big:
                assert p["held"] == 0 and not p["persist"], p
            held = sum(p["partition"] + p["held"] for p in sharding["params"])
            total = sum(p["ds_numel"] for p in sharding["params"])
            assert held < 0.75 * total, (held, total)

    if zero_stage == 3:  # sampler snapshots: gathered a module at a time, shared when unchanged, bounded
        for report in reports:
            snap = report["snapshots"]
            assert snap["largest_module"] < snap["total"] / 2, snap  # else per module would prove nothing
            assert snap["peak_per_module"] <= snap["largest_module"], snap
            assert snap["peak_default"] <= max(snap["bucket"], snap["largest_module"]), snap
            assert snap["equal_to_whole_gather"], "a snapshot gathered in pieces differs from the whole gather"
            assert snap["gathers_for_two_unchanged"] == 1 and snap["shared"], snap
            assert snap["bytes_two_unchanged"] == snap["one_snapshot_bytes"], snap
            assert snap["changed_by_step"] and snap["held_after_step"] == ["c"], snap
            assert snap["held_bytes"] <= snap["max_bytes"], snap


def test_the_sdk_trains_a_named_model_in_bf16_with_checkpointing_on_zero3(tmp_path: Path, qwen3_dir: Path) -> None:
    """``--base-model NAME=PATH --dtype bf16 --gradient-checkpointing`` on ZeRO-3, through the SDK: two LoRA clients
    with Tinker's default rank on one base model; one trains (its loss falls, its samples come back), the other's
    outputs stay those of the base model (the shared base is never written) and equal a plain bf16 PyTorch forward."""
    require("tinker")
    if not unmanaged_stage_supported(3):
        pytest.skip("this DeepSpeed does not support unmanaged mode with ZeRO stage 3")
    import tinker
    import torch
    from tinker import types
    from tinker_sdk_helpers import API_KEY, NAMED_MODEL, RESULT_TIMEOUT_S, adam, log_tail, stop_server

    from deepspeed_tinker.launch import ServerProcess
    from deepspeed_tinker.model import DEFAULT_LORA_RANK, build_model, register_local_model, token_logprobs

    server = ServerProcess(world_size=2, zero_stage=3, checkpoint_dir=tmp_path / "ckpt",
                           log_path=tmp_path / "server.log",
                           extra_args=["--long-poll-s", "1", "--device", "cpu", "--dtype", "bf16",
                                       "--gradient-checkpointing", "--base-model", f"{NAMED_MODEL}={qwen3_dir}"])
    server.start(timeout_s=300)
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    try:
        assert "ZeRO stage 3, bf16, gradient checkpointing" in log_tail(server, 200)
        trained, other = (service.create_lora_training_client(base_model=NAMED_MODEL, seed=seed)
                          .result(timeout=RESULT_TIMEOUT_S) for seed in (1, 2))
        assert trained.get_info().lora_rank == DEFAULT_LORA_RANK == 32
        ids = list(b"bf16 on real architectures")
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:]})

        def logprobs(client) -> np.ndarray:
            out = client.forward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
            return out.loss_fn_outputs[0]["logprobs"].to_numpy()

        before = logprobs(other)
        losses = []
        for _ in range(4):
            out = trained.forward_backward([datum], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
            losses.append(out.metrics["loss:sum"])
            trained.optim_step(types.AdamParams(**adam(learning_rate=1e-2))).result(timeout=RESULT_TIMEOUT_S)
        assert losses[-1] < losses[0] - 1.0, losses
        np.testing.assert_array_equal(logprobs(other), before)

        spec = register_local_model(f"{NAMED_MODEL}={qwen3_dir}")
        from deepspeed_tinker.model import LoraSpec

        plain = build_model(spec.name, LoraSpec(rank=DEFAULT_LORA_RANK, seed=2), torch.bfloat16)
        with torch.no_grad():
            expected = token_logprobs(plain, torch.tensor([ids[:-1]]), torch.tensor([ids[1:]]))[0].numpy()
        np.testing.assert_allclose(before, expected, rtol=0, atol=2e-2)

        sampler = trained.save_weights_and_get_sampling_client().result(timeout=RESULT_TIMEOUT_S)
        result = sampler.sample(types.ModelInput.from_ints(ids[:4]), 2,
                                types.SamplingParams(max_tokens=6, seed=5, stop=[])).result(timeout=RESULT_TIMEOUT_S)
        assert [len(s.tokens) for s in result.sequences] == [6, 6]
        assert all(np.isfinite(s.logprobs).all() for s in result.sequences)
    finally:
        service.close("success").result(timeout=30)
        stop_server(server)
