"""Drive real DeepSpeed engines through the same data in managed and unmanaged mode.

Every helper here runs on a rank (inside a harness body). Data depends only on (rank, step, micro-batch),
so two engines fed by the same plan see identical inputs and any difference is the engine's.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

MICRO_BATCH = 2
FEATURES = 8
HIDDEN = 13  # 173 parameters in TinyMLP: not divisible by 2 or 4, so ZeRO pads partitions
OUTPUTS = 4


class TinyMLP(torch.nn.Module):
    """Two small layers; their parameter count does not divide by the world size."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def make_model(seed: int = 1234) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyMLP()


def base_config(gas: int = 1,
                *,
                managed: bool | None = None,
                stage: int = 0,
                dtype: str = "fp32",
                **extra: Any) -> dict:
    """A small, explicit ds_config (gradient_clipping is set: DeepSpeed's default is 1.0, not 0)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-2,
                "weight_decay": 0.01,
                "torch_adam": True
            }
        },
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": stage
        },
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
    if managed is not None:
        config["managed_gradient_accumulation"] = managed
    return merge(config, extra)


def merge(base: dict, extra: dict) -> dict:
    """Deep-merge ``extra`` into a copy of ``base`` (a ``None`` value removes the key)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def micro_batch(step: int, index: int, rank: int | None = None, dtype: torch.dtype = torch.float32):
    """Deterministic inputs and targets for one micro-batch of one rank."""
    import deepspeed.comm as dist

    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * index + rank)
    x = torch.randn(MICRO_BATCH, FEATURES, generator=g)
    y = torch.randn(MICRO_BATCH, OUTPUTS, generator=g)
    return x.to(dtype), y.to(dtype)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y.float()).pow(2).mean()


def uses_nvme(config: dict) -> bool:
    """Whether ``config`` offloads the optimizer or the parameters to NVMe (DeepSpeed's async I/O op)."""
    zero = config.get("zero_optimization") or {}
    return any((zero.get(key) or {}).get("device") == "nvme" for key in ("offload_optimizer", "offload_param"))


@functools.cache
def nvme_unavailable_reason() -> str | None:
    """Why NVMe offload cannot run on this machine, or None: DeepSpeed JIT-builds its async I/O op from libaio.

    The one check every NVMe test path goes through (``initialize``), so a machine without libaio-dev skips
    them with this reason, as ``ds_series.build_ops`` announces, instead of failing in DeepSpeed's op loader.
    """
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is not None and builder.is_compatible(verbose=False):
        return None
    return ("NVMe offload needs DeepSpeed's async I/O op, and AsyncIOBuilder is not compatible with this machine "
            "(install libaio-dev: apt-get install libaio-dev)")


def initialize(config: dict, model_fn: Callable[[], torch.nn.Module] = make_model, **kwargs):
    """``deepspeed.initialize`` on ``model_fn()``; skips the test (on every rank) if ``config`` needs NVMe here
    and this machine cannot build DeepSpeed's async I/O op."""
    import deepspeed

    if uses_nvme(config) and (reason := nvme_unavailable_reason()) is not None:
        import pytest

        pytest.skip(reason)
    model = model_fn()
    if "model_parameters" not in kwargs:
        params = [p for p in model.parameters() if p.requires_grad]
        if any(getattr(p, "allreduce", True) is False for p in params):  # MoE experts get their own groups
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
            params = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "params"})
        kwargs["model_parameters"] = params
    engine, *_ = deepspeed.initialize(model=model, config=config, **kwargs)
    return engine


def model_dtype(engine) -> torch.dtype:
    return next(engine.module.parameters()).dtype


_CURRENT = (0, 0)


def current_micro_batch() -> tuple[int, int]:
    """(step, index) of the micro-batch being forwarded, for models whose control flow depends on it."""
    return _CURRENT


def forward_loss(engine, step: int, index: int) -> torch.Tensor:
    global _CURRENT
    _CURRENT = (step, index)
    x, y = micro_batch(step, index, dtype=model_dtype(engine))
    return loss_fn(engine(x.to(engine.device)), y.to(engine.device))


# ----------------------------------------------------------------------------------------------
# The three ways of running one logical step
# ----------------------------------------------------------------------------------------------


def run_unmanaged(engine,
                  plan: Sequence[int],
                  *,
                  first_step: int = 0,
                  divide_by_n: bool = False,
                  torch_style: bool = False) -> None:
    """N backwards then one step() per entry of ``plan``."""
    for offset, n in enumerate(plan):
        step = first_step + offset
        for i in range(n):
            loss = forward_loss(engine, step, i)
            backward(engine, loss / n if divide_by_n else loss, scale_wrt_gas=not divide_by_n, torch_style=torch_style)
            assert not engine.is_gradient_accumulation_boundary()
        engine.step()
        assert not engine.is_gradient_accumulation_boundary()


def run_managed(engine, plan: Sequence[int], *, first_step: int = 0) -> None:
    """Managed mode with gradient_accumulation_steps = N: backward + step() on every micro-batch."""
    for offset, n in enumerate(plan):
        assert n == engine.gradient_accumulation_steps(), "managed mode needs N == gradient_accumulation_steps"
        for i in range(n):
            engine.backward(forward_loss(engine, first_step + offset, i))
            engine.step()


def run_boundary_driven(engine, plan: Sequence[int], *, first_step: int = 0) -> None:
    """Today's workaround for a variable N: toggle set_gradient_accumulation_boundary() per backward."""
    for offset, n in enumerate(plan):
        for i in range(n):
            engine.set_gradient_accumulation_boundary(i == n - 1)
            engine.backward(forward_loss(engine, first_step + offset, i) / n, scale_wrt_gas=False)
            engine.step()


def backward(engine, loss: torch.Tensor, *, scale_wrt_gas: bool = True, torch_style: bool = False) -> None:
    if torch_style:
        # The engine's gradient hook divides by gradient_accumulation_steps, as engine.backward() does.
        assert scale_wrt_gas, "torch-style backward always scales by gradient_accumulation_steps"
        engine.scale(loss).backward()
    else:
        engine.backward(loss, scale_wrt_gas=scale_wrt_gas)


# ----------------------------------------------------------------------------------------------
# What users rely on, captured for a bitwise comparison
# ----------------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """Parameters, optimizer state and step bookkeeping of one rank, as plain comparable values."""

    params: dict[str, torch.Tensor]
    optimizer: list[tuple[str, Any]]
    scalars: dict[str, Any] = field(default_factory=dict)


def snapshot(engine) -> Snapshot:
    params = {name: tensor_copy(p) for name, p in engine.module.named_parameters()}
    optimizer_state = flatten(engine.optimizer.state_dict()) if engine.optimizer is not None else []
    # ZeRO-3's flat fp32 groups hold the master weights (compared as params) plus alignment padding that
    # is uninitialised memory.
    optimizer_state = [(path, value) for path, value in optimizer_state if "fp32_flat_groups" not in path]
    scale = engine._get_optimizer_loss_scale()
    norm = engine.get_global_grad_norm()
    scalars = {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "lr": engine.get_lr(),
        "grad_norm": float(norm) if norm is not None else None,
        "loss_scale": float(scale) if scale is not None else None,
        "was_step_applied": engine.was_step_applied(),
    }
    return Snapshot(params, optimizer_state, scalars)


def tensor_copy(t: torch.Tensor) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(t) if hasattr(t, "ds_id") else None
    return (full if full is not None else t).detach().clone().cpu()


def flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """A nested state dict as sorted (path, leaf) pairs; tensors stay tensors for a bitwise compare."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj.detach().clone().cpu())]
    if isinstance(obj, dict):
        return [kv for key in sorted(obj, key=str) for kv in flatten(obj[key], f"{prefix}/{key}")]
    if isinstance(obj, (list, tuple)):
        return [kv for i, item in enumerate(obj) for kv in flatten(item, f"{prefix}[{i}]")]
    if isinstance(obj, (int, float, str, bool, type(None))):
        return [(prefix, obj)]
    if hasattr(obj, "__dict__"):
        return flatten(vars(obj), f"{prefix}<{type(obj).__name__}>")
    return [(prefix, type(obj).__name__)]  # not repr(): it may hold a memory address


def differences(a: Snapshot, b: Snapshot, ignore: Iterable[str] = (), *, rounding: bool = False) -> list[str]:
    """Every place where two snapshots are not bitwise identical (empty when they are); with ``rounding``, only the
    places that differ by more than a different order of floating-point summation explains."""
    same = _close if rounding else bitwise_equal
    out = []
    if a.params.keys() != b.params.keys():
        out.append(f"parameter names differ: {sorted(a.params)} vs {sorted(b.params)}")
    for name in sorted(a.params.keys() & b.params.keys()):
        if not same(a.params[name], b.params[name]):
            diff = (a.params[name].double() - b.params[name].double()).abs().max().item()
            out.append(f"param {name}: max abs diff {diff:.3e}")
    paths_a = [k for k, _ in a.optimizer]
    paths_b = [k for k, _ in b.optimizer]
    if paths_a != paths_b:
        out.append(f"optimizer state layout differs: {set(paths_a) ^ set(paths_b)}")
    for (path, va), (_, vb) in zip(a.optimizer, b.optimizer):
        if isinstance(va, torch.Tensor) or isinstance(vb, torch.Tensor):
            if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and same(va, vb)):
                out.append(f"optimizer state {path} differs")
        elif va != vb and not (va != va and vb != vb) and not (rounding and _close_numbers(va, vb)):
            out.append(f"optimizer state {path}: {va!r} vs {vb!r}")  # NaN == NaN for this purpose
    for key in a.scalars:
        va, vb = a.scalars[key], b.scalars.get(key)
        if key not in ignore and va != vb and not (rounding and _close_numbers(va, vb)):
            out.append(f"{key}: {va!r} vs {vb!r}")
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-7, equal_nan=True)


def _close_numbers(a: Any, b: Any) -> bool:
    return isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_identical(a: Snapshot, b: Snapshot, what: str = "", ignore: Iterable[str] = (), *,
                     rounding: bool = False) -> None:
    diffs = differences(a, b, ignore, rounding=rounding)
    kind = "equal up to summation order" if rounding else "bitwise identical"
    assert not diffs, f"{what} not {kind}:\n  " + "\n  ".join(diffs[:20])


def assert_params_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str, *, rtol: float,
                        atol: float) -> None:
    """Every parameter of ``expected`` within tolerance, for comparisons whose summation order differs."""
    for name, p in expected.items():
        torch.testing.assert_close(actual[name], p, rtol=rtol, atol=atol, msg=lambda m: f"{what}, {name}: {m}")


def destroy(*engines: Iterable) -> None:
    """Release engines between configurations on a long-lived rank."""
    for engine in engines:
        if hasattr(engine, "destroy"):
            engine.destroy()
