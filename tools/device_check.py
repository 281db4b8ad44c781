"""The 0.19.8 series' GPU-only paths, on one CUDA GPU with NCCL at world size 1, in a few minutes.

What the CPU suite cannot run: FusedAdam, ZenFlow, SuperOffload, DeepCompile, NCCL, and the gradient-API matrix
on CUDA. Run by ``tools/device_check.sh`` on a machine with one CUDA GPU; writes a Markdown table of the checks
(pass, fail with the reason, or error) to the path given as the first argument, and exits 1 if any check failed.

Every check compares the series' behaviour with its own reference in the same process: managed against unmanaged
mode, a ZeRO stage against stage 0, a refused configuration against its error message.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

HIDDEN = 64
MICRO_BATCHES = 3
STEPS = 3
#: ``DEVICE_CHECK_CPU_SMOKE=1`` runs the checks that need no GPU on the CPU accelerator with gloo, to try the script
SMOKE = os.environ.get("DEVICE_CHECK_CPU_SMOKE") == "1"
DEVICE = "cpu" if SMOKE else "cuda"


@dataclass(frozen=True)
class Outcome:
    """One check's result: its name, whether it passed, what it measured or why it failed, and its seconds."""

    name: str
    passed: bool
    detail: str
    seconds: float


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; ``use_b`` switches the second head on (only the first micro-batch of a step uses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head_a = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head_b = torch.nn.Linear(HIDDEN, HIDDEN)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.trunk(x))
        out = self.head_a(hidden)
        if self.use_b:
            out = out + self.head_b(hidden)
        return out.float().pow(2).mean()


def _config(stage: int, managed: bool, dtype: str, offload: str = "none", **more) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": MICRO_BATCHES if managed else 1,
        "managed_gradient_accumulation": managed,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    config.update(more)
    return config


def _engine(config: dict, model: torch.nn.Module | None = None):
    import deepspeed

    torch.manual_seed(0)
    model = model or TwoHeads()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _batch(step: int, index: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(4, HIDDEN, generator=generator).to(DEVICE, dtype)


def _train(config: dict, rewrite: bool) -> dict[str, torch.Tensor]:
    """STEPS steps of MICRO_BATCHES micro-batches, head b used in the first only; with ``rewrite`` every gradient
    goes through 2 g + 0.01 (safe_get_full_grad, safe_set_full_grad) after the last backward of each step."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_set_full_grad

    engine = _engine(config)
    managed = config["managed_gradient_accumulation"]
    dtype = torch.bfloat16 if "bf16" in config else torch.float32
    for step in range(STEPS):
        for index in range(MICRO_BATCHES):
            engine.module.use_b = index == 0
            loss = engine(_batch(step, index, dtype))
            if managed:
                engine.backward(loss)
                if index < MICRO_BATCHES - 1:
                    engine.step()
            else:
                engine.backward(loss / MICRO_BATCHES, scale_wrt_gas=False)
        if rewrite:
            for param in engine.module.parameters():
                safe_set_full_grad(param, 2 * safe_get_full_grad(param) + 0.01)
        engine.step()
    params = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)
        params[name] = (full if full is not None else param).detach().float().cpu().clone()
    engine.destroy()
    return params


def _max_diff(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def check_fused_adam_unmanaged_equals_managed() -> str:
    """FusedAdam (DeepSpeed's config Adam on CUDA), ZeRO 0-3, bf16: unmanaged equals managed GAS 3."""
    results = []
    for stage in range(4):
        config = _config(stage, True, "bf16", optimizer={"type": "Adam", "params": {"lr": 1e-3}})
        managed = _train(config, rewrite=False)
        unmanaged = _train({**config, "managed_gradient_accumulation": False, "gradient_accumulation_steps": 1},
                           rewrite=False)
        diff = _max_diff(managed, unmanaged)
        assert diff <= 1e-2, f"ZeRO-{stage}: unmanaged differs from managed by {diff:.2e}"
        results.append(f"ZeRO-{stage} {diff:.1e}")
    return ", ".join(results)


def check_gradient_api_matrix() -> str:
    """Read-modify-write of every gradient before step() at ZeRO 1-3, offload none/CPU, both modes, fp32 and bf16,
    against stage 0 in the same mode and precision."""
    worst = {}
    for dtype, tolerance in (("fp32", 1e-5), ("bf16", 2e-2)):
        for managed in (True, False):
            expected = _train(_config(0, managed, dtype), rewrite=True)
            for stage in (1, 2, 3):
                for offload in ("none", "cpu"):
                    cell = f"{dtype}-{'managed' if managed else 'unmanaged'}-zero{stage}-{offload}"
                    diff = _max_diff(_train(_config(stage, managed, dtype, offload), rewrite=True), expected)
                    assert diff <= tolerance, f"{cell}: {diff:.2e} from stage 0"
                    worst[dtype] = max(worst.get(dtype, 0.0), diff)
    return ", ".join(f"{dtype} within {diff:.1e} of stage 0" for dtype, diff in worst.items())


def _raises(call: Callable[[], object], exception: type, message: str) -> None:
    """``call()`` raises ``exception`` with ``message`` in its text."""
    try:
        call()
    except exception as e:
        assert message in str(e), f"raised with another message: {e}"
        return
    raise AssertionError(f"did not raise: expected {exception.__name__} with {message!r}")


def _refused(config: dict, exception: type, message: str) -> None:
    _raises(lambda: _engine(config).destroy(), exception, message)


def check_zenflow() -> str:
    """ZenFlow ZeRO-2 with offload, unmanaged: trains; zero_grad() with pending passes and step() without a backward
    raise; require_gradient_divide_count is refused."""
    from deepspeed.runtime.config import DeepSpeedConfigError

    zenflow = {"topk_ratio": 0.5, "update_interval": 2, "full_warm_up_rounds": 0, "overlap_step": False}
    config = _config(2, False, "fp32", "cpu")
    config["zero_optimization"]["zenflow"] = zenflow
    engine = _engine(config)
    for step in range(STEPS):
        for index in range(MICRO_BATCHES):
            engine.backward(engine(_batch(step, index, torch.float32)), scale_wrt_gas=False)
        engine.step()
    engine.backward(engine(_batch(9, 0, torch.float32)), scale_wrt_gas=False)
    _raises(engine.zero_grad, RuntimeError, "ZenFlow")  # a discard, with passes pending
    engine.step()
    _raises(engine.step, RuntimeError, "with ZenFlow")  # a step without a backward
    engine.destroy()
    _refused({**config, "require_gradient_divide_count": True}, DeepSpeedConfigError, "ZenFlow")
    return "trains; discard and step without backward refused; divide count refused"


def check_superoffload() -> str:
    """SuperOffload (ZeRO-3), unmanaged: trains and equals managed GAS 3 within bf16 rounding; a discard leaves the
    next step to the later passes; require_gradient_divide_count is refused."""
    from deepspeed.runtime.config import DeepSpeedConfigError

    config = _config(3, True, "bf16", "cpu")
    config["zero_optimization"]["offload_optimizer"]["super_offload"] = True
    managed = _train(config, rewrite=False)
    unmanaged_config = {**config, "managed_gradient_accumulation": False, "gradient_accumulation_steps": 1}
    unmanaged = _train(unmanaged_config, rewrite=False)
    diff = _max_diff(managed, unmanaged)
    assert diff <= 2e-2, f"unmanaged differs from managed by {diff:.2e}"
    engine = _engine(unmanaged_config)
    engine.backward(engine(_batch(0, 0, torch.bfloat16)), scale_wrt_gas=False)
    engine.zero_grad()
    engine.backward(engine(_batch(0, 1, torch.bfloat16)), scale_wrt_gas=False)
    engine.step()
    engine.destroy()
    _refused({**unmanaged_config, "require_gradient_divide_count": True}, DeepSpeedConfigError, "SuperOffload")
    return f"unmanaged within {diff:.1e} of managed; discard then step runs; divide count refused"


def check_deepcompile() -> str:
    """DeepCompile ZeRO-3 (managed) trains through the stale-partition tracking it turns off; unmanaged mode with
    DeepCompile is refused at initialize."""
    from deepspeed.runtime.config import DeepSpeedConfigError

    config = _config(3, True, "bf16", compile={"deepcompile": True})
    engine = _engine(config)
    engine.compile()
    assert engine.optimizer._track_grad_partition_writes is False
    losses = []
    for step in range(STEPS):
        for index in range(MICRO_BATCHES):
            loss = engine(_batch(step, index, torch.bfloat16))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    engine.destroy()
    assert all(torch.isfinite(torch.tensor(losses))), losses
    _refused({**config, "managed_gradient_accumulation": False, "gradient_accumulation_steps": 1},
             DeepSpeedConfigError, "DeepCompile")
    return f"{len(losses)} managed micro-steps, last loss {losses[-1]:.4f}; unmanaged refused"


def check_divide_count_device_tensor() -> str:
    """require_gradient_divide_count at ZeRO-2 with a CUDA tensor count: raw losses divided by the count at step()
    train as losses pre-divided by it."""
    runs = []
    for divide_at_step in (True, False):
        config = _config(2, False, "fp32", require_gradient_divide_count=divide_at_step, gradient_clipping=0.0)
        engine = _engine(config)
        for step in range(STEPS):
            for index in range(MICRO_BATCHES):
                loss = engine(_batch(step, index, torch.float32))
                engine.backward(loss if divide_at_step else loss / MICRO_BATCHES, scale_wrt_gas=False)
            if divide_at_step:
                engine.step(gradient_divide_count=torch.tensor(MICRO_BATCHES, device=DEVICE))
            else:
                engine.step()
        runs.append({name: p.detach().float().cpu().clone() for name, p in engine.module.named_parameters()})
        engine.destroy()
    diff = _max_diff(*runs)
    # Adam on gradients divided after the reduction rather than before it: equal up to rounding
    assert diff <= 1e-5, f"count at step() differs from pre-divided losses by {diff:.2e}"
    return f"within {diff:.1e} of pre-divided losses"


CHECKS: list[Callable[[], str]] = [
    check_fused_adam_unmanaged_equals_managed,
    check_gradient_api_matrix,
    check_divide_count_device_tensor,
    check_zenflow,
    check_superoffload,
    check_deepcompile,
]
#: What the CPU smoke run can run
CPU_CHECKS = [check_gradient_api_matrix, check_divide_count_device_tensor]


def main(report: str) -> int:
    import deepspeed

    assert SMOKE or torch.cuda.is_available(), "the device check needs a CUDA GPU"
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29600"}.items():
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo" if SMOKE else "nccl")
    outcomes = []
    for check in CPU_CHECKS if SMOKE else CHECKS:
        start = time.perf_counter()
        try:
            outcomes.append(Outcome(check.__name__, True, check(), time.perf_counter() - start))
        except Exception as e:  # one check's failure must not hide the others'
            traceback.print_exc()
            outcomes.append(Outcome(check.__name__, False, f"{type(e).__name__}: {e}", time.perf_counter() - start))
        print(outcomes[-1], flush=True)
    device = "CPU (smoke run, gloo)" if SMOKE else f"{torch.cuda.get_device_name()} (NCCL)"
    lines = [f"Device check of DeepSpeed {deepspeed.__version__} on {device}, torch {torch.__version__}, world size 1",
             "", "| check | result | detail | seconds |",
             "| --- | --- | --- | ---: |"]
    lines += [f"| {o.name} | {'pass' if o.passed else 'FAIL'} | {o.detail} | {o.seconds:.0f} |" for o in outcomes]
    with open(report, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "device-check.md"))
