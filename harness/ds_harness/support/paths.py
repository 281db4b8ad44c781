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

from .training import FEATURES, HIDDEN, OUTPUTS, base_config, make_model, merge


@dataclass(frozen=True)
class Path:
    """One engine configuration: extra ds_config keys on top of base_config, and initialize() kwargs."""

    stage: int = 0
    dtype: str = "fp32"
    extra: dict = field(default_factory=dict)
    kwargs: Callable[[], dict] = dict
    model_fn: Callable[[], torch.nn.Module] = make_model
    needs_fp16: bool = False
    zero_init: bool = False  # build the model inside deepspeed.zero.Init

    def config(self, gas: int, managed: bool | None, **more: Any) -> dict:
        return merge(base_config(gas, managed=managed, stage=self.stage, dtype=self.dtype, **self.extra), more)

    def initialize(self, gas: int, managed: bool | None, **more: Any):
        from .training import initialize

        if self.needs_fp16:
            allow_fp16_on_cpu()
        config = self.config(gas, managed, **more)
        model_fn = self.model_fn
        if self.zero_init:
            import deepspeed

            def model_fn() -> torch.nn.Module:
                with deepspeed.zero.Init(config_dict_or_path=config):
                    return self.model_fn()

        return initialize(config, model_fn, **self.kwargs())


def allow_fp16_on_cpu() -> None:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        type(accelerator).is_fp16_supported = lambda self: True


def client_sgd() -> dict:
    return {"optimizer": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)}


def plain_sgd(lr: float) -> dict:
    """Config of DeepSpeed's plain SGD (no momentum, no weight decay): a step on a zero gradient leaves a parameter
    bitwise where it was, and the update is exactly lr times the gradient."""
    return {
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": lr,
                "weight_decay": None,  # merged into base_config's AdamW parameters: None removes the key
                "torch_adam": None
            }
        },
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
    }


def zero3_paths(config: dict, model_fn: Callable[[], torch.nn.Module]) -> dict[str, Path]:
    """ZeRO-3 (every parameter partitioned) without and with CPU optimizer offload, on ``config`` (fp32)."""
    zero = {"stage3_param_persistence_threshold": 0}
    return {
        "zero3": Path(3, "fp32", {**config, "zero_optimization": zero}, model_fn=model_fn),
        "zero3-offload": Path(
            3, "fp32", {**config, "zero_optimization": {**zero, "offload_optimizer": {"device": "cpu"}}},
            model_fn=model_fn),
    }


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
                torch.optim._functional.adamw(params, [p.grad
                                                       for p in params], [self.state[p]["exp_avg"] for p in params],
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


class TwoHeadMLP(torch.nn.Module):
    """A trunk and two heads: a head can get no gradient for a whole step.

    ``use`` picks the heads of the next forward ("a", "b" or "ab"); left unset, even steps train head a
    and odd steps head b.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.head_a = torch.nn.Linear(HIDDEN, OUTPUTS)
        self.head_b = torch.nn.Linear(HIDDEN, OUTPUTS)
        self.use: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .training import current_micro_batch

        use = self.use or ("a" if current_micro_batch()[0] % 2 == 0 else "b")
        h = torch.nn.functional.gelu(self.fc1(x))
        out = self.head_a(h) if "a" in use else 0
        return out + self.head_b(h) if "b" in use else out


def make_two_head_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return TwoHeadMLP()


class WideMLP(torch.nn.Module):
    """~69k parameters (277 KB of fp32 gradients): big enough for memory measurements to mean something."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, width)
        self.mid = torch.nn.Linear(width, width)
        self.fc2 = torch.nn.Linear(width, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.mid(torch.nn.functional.gelu(self.fc1(x)))))


def make_wide_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return WideMLP()


class LoraMLP(torch.nn.Module):
    """A frozen base layer with a trainable low-rank adapter beside it (LoRA-style frozen parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN).requires_grad_(False)
        self.lora_a = torch.nn.Linear(FEATURES, 2, bias=False)
        self.lora_b = torch.nn.Linear(2, HIDDEN, bias=False)
        self.fc2 = torch.nn.Linear(HIDDEN, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x) + self.lora_b(self.lora_a(x))))


def make_lora_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return LoraMLP()


class CheckpointedMLP(torch.nn.Module):
    """The middle of the network recomputed in backward (activation checkpointing)."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.mid = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.nn.functional.gelu(self.mid(t)),
                                              h,
                                              use_reentrant=self.use_reentrant)
        return self.fc2(h)


def make_checkpointed_model(use_reentrant: bool) -> Callable[[], torch.nn.Module]:

    def make() -> torch.nn.Module:
        torch.manual_seed(1234)
        return CheckpointedMLP(use_reentrant)

    return make


class BranchBlock(torch.nn.Module):

    def __init__(self) -> None:
        super().__init__()
        self.branch = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from .training import current_micro_batch

        step, index = current_micro_batch()
        return h + self.branch(h) if (step + index) % 3 == 1 else h


class LeafBranchyMLP(torch.nn.Module):
    """A branch not taken in some micro-batches inside a ZeRO-3 leaf module (gathered as one unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.block = BranchBlock()
        self.fc2 = torch.nn.Linear(HIDDEN, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.block(torch.nn.functional.gelu(self.fc1(x))))


def make_leaf_module_model() -> torch.nn.Module:
    from deepspeed.utils import set_z3_leaf_modules

    torch.manual_seed(1234)
    model = LeafBranchyMLP()
    set_z3_leaf_modules(model, [BranchBlock])
    return model


def make_moe_model() -> torch.nn.Module:
    import deepspeed.comm as dist

    torch.manual_seed(1234)
    return TinyMoE(ep_size=2 if dist.get_world_size() % 2 == 0 else 1)


WARMUP = {
    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 1e-2,
            "warmup_num_steps": 4
        }
    }
}
CLIP = {"gradient_clipping": 0.05}

#: Every optimizer path ZeRO stage 0/1 can take (`zero-0-1`), each with clipping and most with an LR scheduler.
ZERO_0_1_PATHS: dict[str, Path] = {
    "fp32-deepspeed-optimizer": Path(0, "fp32", {
        **CLIP,
        **WARMUP
    }),
    "fp32-client-optimizer": Path(0, "fp32", {
        **CLIP, "optimizer": None
    }, client_sgd),
    "bf16": Path(0, "bf16", {
        **CLIP,
        **WARMUP
    }),
    "fp16-fused": Path(0, "fp16", {
        **CLIP, "optimizer": None
    }, client_fused_adam, needs_fp16=True),
    "fp16-unfused": Path(0, "fp16", {
        **CLIP,
        **WARMUP
    }, needs_fp16=True),
    "fp16-static-scale": Path(0, "fp16", {
        **CLIP, "fp16": {
            "loss_scale": 64
        }
    }, needs_fp16=True),
    "torch-autocast": Path(0, "fp32", {
        **CLIP, "torch_autocast": {
            "enabled": True,
            "dtype": "bfloat16"
        }
    }),
    "moe": Path(0, "fp32", CLIP, model_fn=make_moe_model),
    "branchy": Path(0, "fp32", CLIP, model_fn=make_branchy_model),
    "zero1-fp32": Path(1, "fp32", {
        **CLIP,
        **WARMUP
    }),
    "zero1-bf16-fp32-accumulation": Path(1, "bf16", CLIP),  # BF16_Optimizer
    "zero1-bf16-bf16-accumulation": Path(1, "bf16", {
        **CLIP, "data_types": {
            "grad_accum_dtype": "bf16"
        }
    }),
    "zero1-fp16": Path(1, "fp16", CLIP, needs_fp16=True),
    "zero1-torch-autocast": Path(1, "fp32", {
        **CLIP, "torch_autocast": {
            "enabled": True,
            "dtype": "bfloat16"
        }
    }),
    "zero1-moe": Path(1, "fp32", CLIP, model_fn=make_moe_model),
    "zero1-branchy": Path(1, "fp32", CLIP, model_fn=make_branchy_model),
}


def _zero2(dtype: str = "fp32", needs_fp16: bool = False, model_fn=make_model, **zero: Any) -> Path:
    return Path(2, dtype, {**CLIP, **WARMUP, "zero_optimization": zero}, model_fn=model_fn, needs_fp16=needs_fp16)


#: ZeRO stage 2 and every option a user can set on it (`zero-2`).
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


def _zero3(dtype: str = "fp32", needs_fp16: bool = False, model_fn=make_model, **zero: Any) -> Path:
    # Persistence threshold 0 partitions every parameter; the default keeps these tiny ones whole.
    zero = {"stage3_param_persistence_threshold": 0, **zero}
    return Path(3, dtype, {**CLIP, **WARMUP, "zero_optimization": zero}, model_fn=model_fn, needs_fp16=needs_fp16)


#: ZeRO stage 3 and what its users set (`zero-3`).
ZERO_3_PATHS: dict[str, Path] = {
    "zero3-fp32":
    _zero3(),
    "zero3-persistent-and-partitioned":
    _zero3(stage3_param_persistence_threshold=20),
    "zero3-no-overlap-comm":
    _zero3(overlap_comm=False),
    "zero3-no-contiguous-gradients":
    _zero3(contiguous_gradients=False),
    "zero3-small-buckets":
    _zero3(reduce_bucket_size=40),
    "zero3-prefetch-limits":
    _zero3(stage3_prefetch_bucket_size=20, stage3_max_live_parameters=30, stage3_max_reuse_distance=10),
    "zero3-bf16":
    _zero3("bf16"),
    "zero3-fp16":
    _zero3("fp16", needs_fp16=True),
    "zero3-branchy":
    _zero3(model_fn=make_branchy_model),
    "zero3-frozen-lora":
    _zero3(model_fn=make_lora_model),
    "zero3-checkpointing-reentrant":
    _zero3(model_fn=make_checkpointed_model(True)),
    "zero3-checkpointing-non-reentrant":
    _zero3(model_fn=make_checkpointed_model(False)),
    "zero3-leaf-module":
    _zero3(model_fn=make_leaf_module_model),
    "zero3-zero-init":
    Path(3, "fp32", {
        **CLIP, "zero_optimization": {
            "stage3_param_persistence_threshold": 0
        }
    }, zero_init=True),
}

#: MiCS shards over sub-groups with coalesced collectives, which gloo does not implement: NCCL only, at world
#: size 2 (one shard group: MiCS with replication, a shard size below the data-parallel size, is refused in
#: unmanaged mode).
MICS_PATHS: dict[str, Path] = {"zero3-mics": Path(3, "fp32", {**CLIP, "zero_optimization": {"mics_shard_size": 2}})}

#: Wide models for the gradient-memory measurements (moderate buckets: the 5e8-element default is 2 GB).
MEMORY_PATHS: dict[str, Path] = {
    "zero2-wide":
    _zero2(model_fn=make_wide_model, reduce_bucket_size=20000, allgather_bucket_size=20000),
    "zero2-wide-overlap-comm":
    _zero2(model_fn=make_wide_model, reduce_bucket_size=20000, allgather_bucket_size=20000, overlap_comm=True),
    "zero3-wide":
    _zero3(model_fn=make_wide_model, reduce_bucket_size=20000),
}

PATHS: dict[str, Path] = {**ZERO_0_1_PATHS, **ZERO_2_PATHS, **ZERO_3_PATHS, **MICS_PATHS, **MEMORY_PATHS}

#: Dynamic loss-scale fp16 paths, for the overflow-inside-an-accumulation tests.
FP16_DYNAMIC = ["fp16-fused", "fp16-unfused", "zero1-fp16", "zero2-fp16", "zero3-fp16"]

#: One or two configurations per ZeRO stage, precision and offload mode: ``pytest --paths core`` keeps only
#: these (the second base's run in CI). The full set is the default.
CORE_PATHS = frozenset({
    "fp32-deepspeed-optimizer", "bf16", "fp16-fused", "zero1-fp32", "zero1-bf16-fp32-accumulation", "zero1-fp16",
    "zero2-fp32", "zero2-bf16", "zero2-overlap-comm", "zero2-fp16", "zero3-fp32", "zero3-bf16", "zero3-fp16",
    "zero3-mics", "zero1-offload", "zero2-offload", "zero2-offload-fp16", "zero2-offload-nvme", "zero3-offload",
    "zero3-offload-fp16", "zero3-offload-nvme", "zero3-offload-param", "zero3-offload-param-nvme", "zero2-wide",
    "zero3-wide"
})

# The offload configurations (`zero-offload`) live in their own module, built from the helpers above; importing
# it adds them to PATHS.
from . import offload_paths  # noqa: E402,F401
