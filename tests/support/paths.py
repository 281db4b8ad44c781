"""The optimizer paths an engine can take, as named, reproducible (config, initialize kwargs) recipes.

fp16 is refused by DeepSpeed's CPU accelerator only through its capability check; the fp16 optimizers
themselves are plain torch code. On CPU, ``allow_fp16_on_cpu()`` lifts that check so the fp16 wrappers'
logic (loss scaling, overflow skip, scale update) runs for real. The fused FP16_Optimizer is chosen only
for a ``FusedAdam`` instance, whose CUDA kernel cannot build on CPU: ``TorchFusedAdam`` is a ``FusedAdam``
whose update is torch's AdamW, so the wrapper under test is the real one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .training import HIDDEN, FEATURES, OUTPUTS, base_config, make_model, merge


@dataclass(frozen=True)
class Path:
    """One engine configuration: extra ds_config keys on top of base_config, and initialize() kwargs."""

    stage: int = 0
    dtype: str = "fp32"
    extra: dict = field(default_factory=dict)
    kwargs: Callable[[], dict] = dict
    model_fn: Callable[[], torch.nn.Module] = make_model
    needs_fp16: bool = False

    def config(self, gas: int, managed: bool | None, **more: Any) -> dict:
        return merge(base_config(gas, managed=managed, stage=self.stage, dtype=self.dtype, **self.extra), more)

    def initialize(self, gas: int, managed: bool | None, **more: Any):
        from .training import initialize

        if self.needs_fp16:
            allow_fp16_on_cpu()
        return initialize(self.config(gas, managed, **more), self.model_fn, **self.kwargs())


def allow_fp16_on_cpu() -> None:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        type(accelerator).is_fp16_supported = lambda self: True


def client_sgd() -> dict:
    return {"optimizer": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)}


def client_fused_adam() -> dict:
    return {"optimizer": lambda params: TorchFusedAdam(params, lr=1e-2)}


def _torch_fused_adam_class():
    from deepspeed.ops.adam import FusedAdam

    class _TorchFusedAdam(FusedAdam):
        """A FusedAdam (so DeepSpeed picks the fused FP16_Optimizer) that updates with torch's AdamW."""

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
            torch.optim.Optimizer.__init__(self, params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

        @torch.no_grad()
        def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, **kwargs):
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                for p in params:
                    state = self.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                torch.optim._functional.adamw(params, [p.grad for p in params],
                                              [self.state[p]["exp_avg"] for p in params],
                                              [self.state[p]["exp_avg_sq"] for p in params], [],
                                              [self.state[p]["step"] for p in params],
                                              amsgrad=False,
                                              beta1=group["betas"][0],
                                              beta2=group["betas"][1],
                                              lr=group["lr"],
                                              weight_decay=group["weight_decay"],
                                              eps=group["eps"],
                                              maximize=False)

    return _TorchFusedAdam


def TorchFusedAdam(params, **kwargs):  # noqa: N802 - a class factory, built lazily on the rank
    return _torch_fused_adam_class()(params, **kwargs)


class TinyMoE(torch.nn.Module):
    """A dense layer, a 2-expert MoE layer (expert-parallel over up to 2 ranks) and a head."""

    def __init__(self, ep_size: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.moe = MoE(hidden_size=HIDDEN,
                       expert=torch.nn.Linear(HIDDEN, HIDDEN),
                       num_experts=2,
                       ep_size=ep_size,
                       k=1,
                       min_capacity=0,
                       noisy_gate_policy=None,
                       drop_tokens=False)
        self.fc2 = torch.nn.Linear(HIDDEN, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _aux, _counts = self.moe(torch.nn.functional.gelu(self.fc1(x)))
        return self.fc2(h)


class BranchyMLP(torch.nn.Module):
    """An extra layer used only by some micro-batches (the same ones on every rank): a branch not taken."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.branch = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        if self.take_branch:
            h = h + self.branch(h)
        return self.fc2(h)

    @property
    def take_branch(self) -> bool:
        from .training import current_micro_batch

        step, index = current_micro_batch()
        return (step + index) % 3 == 1


def make_branchy_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return BranchyMLP()


def make_moe_model() -> torch.nn.Module:
    import deepspeed.comm as dist

    torch.manual_seed(1234)
    return TinyMoE(ep_size=2 if dist.get_world_size() % 2 == 0 else 1)


WARMUP = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}}}
CLIP = {"gradient_clipping": 0.05}

#: Every optimizer path ZeRO stage 0/1 can take (PR 1), each with clipping and most with an LR scheduler.
ZERO_0_1_PATHS: dict[str, Path] = {
    "fp32-deepspeed-optimizer": Path(0, "fp32", {**CLIP, **WARMUP}),
    "fp32-client-optimizer": Path(0, "fp32", {**CLIP, "optimizer": None}, client_sgd),
    "bf16": Path(0, "bf16", {**CLIP, **WARMUP}),
    "fp16-fused": Path(0, "fp16", {**CLIP, "optimizer": None}, client_fused_adam, needs_fp16=True),
    "fp16-unfused": Path(0, "fp16", {**CLIP, **WARMUP}, needs_fp16=True),
    "fp16-static-scale": Path(0, "fp16", {**CLIP, "fp16": {"loss_scale": 64}}, needs_fp16=True),
    "torch-autocast": Path(0, "fp32", {**CLIP, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}),
    "moe": Path(0, "fp32", CLIP, model_fn=make_moe_model),
    "branchy": Path(0, "fp32", CLIP, model_fn=make_branchy_model),
    "zero1-fp32": Path(1, "fp32", {**CLIP, **WARMUP}),
    "zero1-bf16-fp32-accumulation": Path(1, "bf16", CLIP),  # BF16_Optimizer
    "zero1-bf16-bf16-accumulation": Path(1, "bf16", {**CLIP, "data_types": {"grad_accum_dtype": "bf16"}}),
    "zero1-fp16": Path(1, "fp16", CLIP, needs_fp16=True),
    "zero1-torch-autocast": Path(1, "fp32", {**CLIP, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}),
    "zero1-moe": Path(1, "fp32", CLIP, model_fn=make_moe_model),
    "zero1-branchy": Path(1, "fp32", CLIP, model_fn=make_branchy_model),
}


def _zero2(dtype: str = "fp32", needs_fp16: bool = False, model_fn=make_model, **zero: Any) -> Path:
    return Path(2, dtype, {**CLIP, **WARMUP, "zero_optimization": zero}, model_fn=model_fn, needs_fp16=needs_fp16)


#: ZeRO stage 2 and every option a user can set on it (PR 2).
ZERO_2_PATHS: dict[str, Path] = {
    "zero2-fp32": _zero2(),
    "zero2-overlap-comm": _zero2(overlap_comm=True),
    "zero2-no-contiguous-gradients": _zero2(contiguous_gradients=False),
    "zero2-overlap-comm-no-contiguous-gradients": _zero2(overlap_comm=True, contiguous_gradients=False),
    "zero2-all-reduce": _zero2(reduce_scatter=False),
    "zero2-round-robin-gradients": _zero2(round_robin_gradients=True),
    # reduce_bucket_size below fc1.weight's 104 elements takes the "extra large parameter" path
    "zero2-small-buckets": _zero2(reduce_bucket_size=40, allgather_bucket_size=64),
    "zero2-small-buckets-overlap-comm": _zero2(reduce_bucket_size=40, allgather_bucket_size=64, overlap_comm=True),
    "zero2-bf16": _zero2("bf16"),
    "zero2-bf16-overlap-comm": _zero2("bf16", overlap_comm=True),
    "zero2-fp16": _zero2("fp16", needs_fp16=True),
    "zero2-moe": _zero2(model_fn=make_moe_model),
    "zero2-branchy": _zero2(model_fn=make_branchy_model),
}

PATHS: dict[str, Path] = {**ZERO_0_1_PATHS, **ZERO_2_PATHS}

#: Dynamic loss-scale fp16 paths, for the overflow-inside-an-accumulation tests.
FP16_DYNAMIC = ["fp16-fused", "fp16-unfused", "zero1-fp16", "zero2-fp16"]
