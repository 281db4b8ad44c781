"""The DeepSpeed worker's small pure pieces, with stand-in engines (no DeepSpeed, no ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tinker_sdk_helpers import require

require("peft")
require("transformers")

from deepspeed_tinker.jobs import AdamParams  # noqa: E402
from deepspeed_tinker.model import LoraSpec, build_model, cross_entropy_sum, token_logprobs  # noqa: E402
from deepspeed_tinker.wire import Datum  # noqa: E402
from deepspeed_tinker.worker import apply_step_hyperparameters, pad_batch, share, sum_over_ranks  # noqa: E402

pytestmark = pytest.mark.pr("zero-0-1")


def test_shares_cover_every_datum_once_in_order() -> None:
    for n in range(0, 9):
        for world in (1, 2, 3):
            indices = [i for r in range(world) for i in share(n, r, world)]
            assert indices == list(range(n))


def test_sum_over_ranks_prefers_gradient_divide_factor() -> None:
    class WithFactor:
        dp_world_size = 4

        def step(self, lr_kwargs=None, gradient_divide_factor=None):
            pass

    class Averaging:
        dp_world_size = 4

        def step(self, lr_kwargs=None):
            pass

    assert sum_over_ranks(WithFactor()) == (1.0, {"gradient_divide_factor": 1.0})
    assert sum_over_ranks(Averaging()) == (4.0, {})


def test_step_hyperparameters_reach_every_group_and_the_clip_norm() -> None:
    groups = [{"lr": 0.0, "betas": (0, 0), "eps": 0, "weight_decay": 0}, {"lr": 0.0}]
    engine = SimpleNamespace(optimizer=SimpleNamespace(param_groups=groups, clip_grad=1.0),
                             _config=SimpleNamespace(gradient_clipping=1.0))
    apply_step_hyperparameters(engine, AdamParams(learning_rate=0.1, beta1=0.8, beta2=0.9, eps=1e-6,
                                                  weight_decay=0.01, grad_clip_norm=0.0))
    for group in groups:
        assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.1, (0.8, 0.9), 1e-6, 0.01)
    assert engine.optimizer.clip_grad == 0.0 and engine._config.gradient_clipping == 0.0


def test_padding_changes_no_logprob_and_adds_no_loss() -> None:
    model = build_model("tiny-llama-byte", LoraSpec(rank=2, seed=0))
    data = [Datum(np.array([5, 6, 7, 8]), np.array([6, 7, 8, 9]), np.ones(4, np.float32)),
            Datum(np.array([1, 2]), np.array([2, 3]), np.array([1.0, 0.5], np.float32))]
    tokens, targets, weights = pad_batch(data)
    with torch.no_grad():
        batched = token_logprobs(model, tokens, targets)
        for i, d in enumerate(data):
            alone = token_logprobs(model, torch.from_numpy(d.tokens)[None], torch.from_numpy(d.targets)[None])[0]
            torch.testing.assert_close(batched[i, :len(d.tokens)], alone, atol=1e-5, rtol=0)
        expected = sum(float(cross_entropy_sum(token_logprobs(model, torch.from_numpy(d.tokens)[None],
                                                              torch.from_numpy(d.targets)[None])[0],
                                               torch.from_numpy(d.weights))) for d in data)
        assert float(cross_entropy_sum(batched, weights)) == pytest.approx(expected, rel=1e-5)
    idle_tokens, _, idle_weights = pad_batch([])
    assert idle_tokens.shape == (1, 1) and float(idle_weights.sum()) == 0.0


def test_models_are_reproducible_from_name_and_seed() -> None:
    a = build_model("tiny-llama-byte", LoraSpec(rank=2, seed=5))
    b = build_model("tiny-llama-byte", LoraSpec(rank=2, seed=5))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    trainable = {n for n, p in a.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable), "LoRA trains only the adapters"
    assert all(p.requires_grad for p in build_model("tiny-llama-byte", None).parameters())


def test_lora_scale_is_tinkers_alpha_over_rank() -> None:
    """Tinker's LoRA: alpha 32 whatever the rank, so the adapter's scale is 32 / rank."""
    from deepspeed_tinker.model import LORA_ALPHA

    for rank in (1, 4, 32):
        model = build_model("tiny-llama-byte", LoraSpec(rank=rank, seed=0))
        q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
        assert LORA_ALPHA == 32 and q_proj.scaling["default"] == 32 / rank


def test_lora_models_share_one_base_and_full_fine_tuning_copies() -> None:
    """``build_model(base=...)``: a LoRA model over the base's own tensors (one copy, whatever the number of
    clients), numerically the model built on its own; full fine-tuning cannot share."""
    from deepspeed_tinker.model import build_base

    base = build_base("tiny-llama-byte")
    a, b = (build_model("tiny-llama-byte", LoraSpec(rank=2, seed=s), base=base) for s in (1, 2))
    alone = build_model("tiny-llama-byte", LoraSpec(rank=2, seed=1))
    frozen = dict(base.named_parameters())
    for model in (a, b):
        for name, param in model.named_parameters():
            if not param.requires_grad:
                key = name.removeprefix("base_model.model.").replace(".base_layer", "")
                assert param is frozen[key], name
    for (name, x), (_, y) in zip(a.state_dict().items(), alone.state_dict().items()):
        assert torch.equal(x, y), name
    with pytest.raises(ValueError, match="cannot share"):
        build_model("tiny-llama-byte", None, base=base)
