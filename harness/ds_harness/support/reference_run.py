"""Fixed managed-mode runs whose results the series must leave untouched, bit for bit.

With ``managed_gradient_accumulation`` absent, DeepSpeed must compute exactly what it computed before the
series. ``ds_harness.support.pristine`` runs these cases on a DeepSpeed tree without the unmanaged PRs (the pinned
sdist plus the series' leading bug-fix PRs), imported from its folder on the machine that runs the tests;
``tests/unmanaged/test_default_unchanged.py`` runs them on the installed DeepSpeed and compares.

Every case covers one configuration the series touches: ZeRO 0-3 in fp32, bf16 and fp16, clipping on
and off, CPU and NVMe optimizer offload, ZeRO-3 parameter offload, MoE, ``overlap_comm``,
``contiguous_gradients``, parameters unused in some micro-batches or in whole steps, ``zero_grad()``
(the engine's, and the ZeRO-2 optimizer's) between micro-batches, a checkpoint save and load,
``no_sync()`` and an fp16 overflow.

``EVERY_GRADIENT_CASES`` is a second table for ``tests/fixes/test_fixes_match_pristine.py``: only
configurations in which every parameter gets a gradient in every micro-batch, run against pristine 0.19.3.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .offload_paths import AIO, CPU_ADAM, NVME, _offload, _offload3
from .paths import (
    CLIP,
    WARMUP,
    Path,
    _zero2,
    _zero3,
    client_fused_adam,
    make_branchy_model,
    make_moe_model,
    make_two_head_model,
    make_wide_model,
)
from .training import destroy, flatten, forward_loss, nvme_unavailable_reason

#: Managed steps per case, of ``Case.gas`` micro-batches each (GAS by default).
STEPS = 3
GAS = 2
#: Clipping off.
NO_CLIP = {"gradient_clipping": 0.0}
#: ``gradient_clipping`` absent: DeepSpeed's default (1.0) is part of the default behaviour.
DEFAULT_CLIP = {"gradient_clipping": None}


@dataclass(frozen=True)
class Case:
    """An engine configuration and the managed-mode loop that drives it."""

    path: Path
    #: "plain", "zero_grad_between", "optimizer_zero_grad_between", "no_sync", "fp16_overflow", "checkpoint" or
    #: "safe_full_grad_between"
    drive: str = "plain"
    more: dict = field(default_factory=dict)
    needs_aio: bool = False
    #: Micro-batches per step (``gradient_accumulation_steps``).
    gas: int = GAS
    #: Runs only with CUDA GPUs (NCCL): ZenFlow, SuperOffload and DeepCompile need them.
    needs_cuda: bool = False


def _case(path: Path, drive: str = "plain", gas: int = GAS, needs_cuda: bool = False, **more: Any) -> Case:
    """A case; ``more`` are ds_config keys on top of the path's (``None`` removes one)."""
    return Case(path, drive, more, needs_aio="nvme" in repr(path.extra), gas=gas, needs_cuda=needs_cuda)


_Z0 = Path(0, "fp32", {**CLIP, **WARMUP})
_Z1 = Path(1, "fp32", {**CLIP, **WARMUP})
_Z2 = _zero2()
_Z3 = _zero3()

#: Every configuration the series touches, at a size that keeps all of them CI-sized.
CASES: dict[str, Case] = {
    # ZeRO 0: the engine's own all-reduce, every precision and optimizer wrapper.
    "zero0-fp32-default-clip": _case(_Z0, **DEFAULT_CLIP),
    "zero0-fp32-no-clip": _case(_Z0, **NO_CLIP),
    "zero0-fp32-clip": _case(_Z0),
    "zero0-bf16": _case(Path(0, "bf16", CLIP)),
    "zero0-fp16": _case(Path(0, "fp16", {
        **CLIP,
        **WARMUP
    }, needs_fp16=True)),
    "zero0-fp16-fused": _case(Path(0, "fp16", {
        **CLIP, "optimizer": None
    }, client_fused_adam, needs_fp16=True)),
    "zero0-fp16-overflow": _case(Path(0, "fp16", CLIP, needs_fp16=True), "fp16_overflow"),
    "zero0-moe": _case(Path(0, "fp32", CLIP, model_fn=make_moe_model)),
    "zero0-unused-some-micro-batches": _case(Path(0, "fp32", CLIP, model_fn=make_branchy_model)),
    "zero0-unused-whole-steps": _case(Path(0, "fp32", CLIP, model_fn=make_two_head_model)),
    "zero0-zero-grad-between": _case(_Z0, "zero_grad_between"),
    "zero0-no-sync": _case(_Z0, "no_sync"),
    "zero0-checkpoint": _case(_Z0, "checkpoint"),
    # ZeRO 1
    "zero1-fp32-default-clip": _case(_Z1, **DEFAULT_CLIP),
    "zero1-fp32-no-clip": _case(_Z1, **NO_CLIP),
    "zero1-bf16": _case(Path(1, "bf16", CLIP)),
    "zero1-fp16": _case(Path(1, "fp16", CLIP, needs_fp16=True)),
    "zero1-fp16-overflow": _case(Path(1, "fp16", CLIP, needs_fp16=True), "fp16_overflow"),
    "zero1-moe": _case(Path(1, "fp32", CLIP, model_fn=make_moe_model)),
    "zero1-unused-whole-steps": _case(Path(1, "fp32", CLIP, model_fn=make_two_head_model)),
    "zero1-no-sync": _case(_Z1, "no_sync"),
    "zero1-checkpoint": _case(_Z1, "checkpoint"),
    "zero1-offload": _case(_offload(1)),
    "zero1-offload-bf16-no-clip": _case(_offload(1, "bf16"), **NO_CLIP),
    "zero1-offload-unused-some-micro-batches": _case(_offload(1, model_fn=make_branchy_model)),
    "zero1-offload-unused-whole-steps": _case(_offload(1, model_fn=make_two_head_model)),
    # ZeRO 2
    "zero2-fp32-default-clip": _case(_Z2, **DEFAULT_CLIP),
    "zero2-fp32-no-clip": _case(_Z2, **NO_CLIP),
    "zero2-bf16-overlap-comm": _case(_zero2("bf16", overlap_comm=True)),
    "zero2-fp16": _case(_zero2("fp16", needs_fp16=True)),
    "zero2-fp16-overflow": _case(_zero2("fp16", needs_fp16=True), "fp16_overflow"),
    "zero2-overlap-comm": _case(_zero2(overlap_comm=True)),
    "zero2-no-contiguous-gradients": _case(_zero2(contiguous_gradients=False)),
    "zero2-moe": _case(_zero2(model_fn=make_moe_model)),
    "zero2-unused-some-micro-batches": _case(_zero2(model_fn=make_branchy_model)),
    "zero2-unused-whole-steps": _case(_zero2(model_fn=make_two_head_model)),
    "zero2-zero-grad-between": _case(_Z2, "zero_grad_between"),
    "zero2-optimizer-zero-grad-between": _case(_Z2, "optimizer_zero_grad_between"),
    "zero2-checkpoint": _case(_Z2, "checkpoint"),
    "zero2-offload": _case(_offload(2)),
    "zero2-offload-fp16-overflow": _case(_offload(2, "fp16", needs_fp16=True), "fp16_overflow"),
    "zero2-offload-unused-some-micro-batches": _case(_offload(2, model_fn=make_branchy_model)),
    "zero2-offload-unused-whole-steps": _case(_offload(2, model_fn=make_two_head_model)),
    "zero2-offload-nvme": _case(_offload(2, device="nvme", nvme_path=NVME["nvme_path"], extra=AIO)),
    # ZeRO 3
    "zero3-fp32-default-clip": _case(_Z3, **DEFAULT_CLIP),
    "zero3-fp32-no-clip": _case(_Z3, **NO_CLIP),
    "zero3-bf16": _case(_zero3("bf16")),
    "zero3-fp16": _case(_zero3("fp16", needs_fp16=True)),
    "zero3-fp16-overflow": _case(_zero3("fp16", needs_fp16=True), "fp16_overflow"),
    "zero3-no-contiguous-gradients": _case(_zero3(contiguous_gradients=False)),
    "zero3-unused-some-micro-batches": _case(_zero3(model_fn=make_branchy_model)),
    "zero3-unused-whole-steps": _case(_zero3(model_fn=make_two_head_model)),
    "zero3-zero-grad-between": _case(_Z3, "zero_grad_between"),
    "zero3-checkpoint": _case(_Z3, "checkpoint"),
    "zero3-offload": _case(_offload3(optimizer={})),
    "zero3-offload-bf16-no-clip": _case(_offload3("bf16", optimizer={}), **NO_CLIP),
    "zero3-offload-unused-whole-steps": _case(_offload3(model_fn=make_two_head_model, optimizer={})),
    "zero3-offload-param": _case(_offload3(param={})),
    "zero3-offload-param-and-optimizer": _case(_offload3(param={}, optimizer={})),
    "zero3-offload-nvme": _case(_offload3(optimizer=NVME, extra={
        **CPU_ADAM,
        **AIO
    })),
}

_NVME_1_2 = {"device": "nvme", "nvme_path": NVME["nvme_path"], "extra": AIO}
#: ZeRO-3's ``safe_set_full_grad`` in 0.19.3 cannot write the padded last partition of a parameter whose size the
#: world size does not divide (``narrow`` past the end): a model whose parameter sizes divide by 2 and 4.
_EVEN_SIZES = {"model_fn": make_wide_model}

#: DeepSpeed's own Adam for the GPU-only writers (ZenFlow and SuperOffload bring their CPU optimizers).
_GPU_ADAM = {"optimizer": {"type": "Adam", "params": {"torch_adam": None}}, "zero_allow_untested_optimizer": True}
#: ZenFlow with CPU optimizer offload (it always offloads), a synchronous update and no warm-up rounds.
ZENFLOW = {
    "offload_optimizer": {
        "device": "cpu"
    },
    "overlap_comm": True,
    "zenflow": {
        "topk_ratio": 0.2,
        "select_strategy": "step",
        "select_interval": 2,
        "update_interval": 2,
        "overlap_step": False,
        "full_warm_up_rounds": 0,
    },
}

_ZENFLOW3 = Path(3, "fp32", {**_GPU_ADAM, "zero_optimization": ZENFLOW})
_SUPEROFFLOAD3 = Path(3, "bf16", {
    **_GPU_ADAM, "zero_optimization": {
        "offload_optimizer": {
            "device": "cpu",
            "super_offload": True
        }
    }
})
_DEEPCOMPILE3 = Path(3, "fp32", {**_GPU_ADAM, "compile": {"deepcompile": True}}, zero_init=True)

#: Configurations in which every parameter gets a gradient in every micro-batch, where each bug-fix PR promises
#: the path of 0.19.3 exactly: ZeRO 0-3 in fp32, bf16 and fp16, clipping on and off, GAS 1 and 2, CPU and NVMe
#: optimizer offload, ZeRO-3 parameter offload, MoE, the user's own gradient access between the boundary backward
#: and ``step()``, and the ZeRO optimizer's ``zero_grad()`` between micro-batches. No model with parameters unused
#: in some micro-batches (there the fixes change results on purpose), and ZeRO-3 keeps no persistent parameter
#: (pristine 0.19.3 races on their re-gather on gloo, fix-zero3-allgather-wait: its results are not reproducible).
EVERY_GRADIENT_CASES: dict[str, Case] = {
    # ZeRO 0, and ZeRO 1/2 without offload: no PR touches them, a few anchors. The fixes' paths: ZeRO-1/2 offload
    # (fix-zero-offload-stale-grads), every ZeRO-3 configuration (fix-zero3-stale-grad-partitions and
    # fix-zero3-allgather-wait).
    "zero0-fp16-gas1": _case(Path(0, "fp16", {
        **CLIP,
        **WARMUP
    }, needs_fp16=True), gas=1),
    # ZeRO 1
    "zero1-fp32-no-clip": _case(_Z1, **NO_CLIP),
    "zero1-bf16-gas1": _case(Path(1, "bf16", CLIP), gas=1),
    "zero1-moe": _case(Path(1, "fp32", CLIP, model_fn=make_moe_model)),
    "zero1-offload": _case(_offload(1)),
    "zero1-offload-bf16-no-clip-gas1": _case(_offload(1, "bf16"), gas=1, **NO_CLIP),
    "zero1-offload-nvme": _case(_offload(1, **_NVME_1_2)),
    "zero1-offload-optimizer-zero-grad-between": _case(_offload(1), "optimizer_zero_grad_between"),
    # ZeRO 2
    "zero2-fp32-no-clip-gas1": _case(_Z2, gas=1, **NO_CLIP),
    "zero2-fp16-gas1": _case(_zero2("fp16", needs_fp16=True), gas=1),
    "zero2-moe": _case(_zero2(model_fn=make_moe_model)),
    "zero2-safe-full-grad": _case(_Z2, "safe_full_grad_between"),
    "zero2-optimizer-zero-grad-between": _case(_Z2, "optimizer_zero_grad_between"),
    "zero2-offload": _case(_offload(2)),
    "zero2-offload-fp16-no-clip-gas1": _case(_offload(2, "fp16", needs_fp16=True), gas=1, **NO_CLIP),
    "zero2-offload-nvme-gas1": _case(_offload(2, **_NVME_1_2), gas=1),
    "zero2-offload-safe-full-grad": _case(_offload(2), "safe_full_grad_between"),
    "zero2-offload-optimizer-zero-grad-between": _case(_offload(2), "optimizer_zero_grad_between"),
    # ZeRO 3
    "zero3-fp32": _case(_Z3),
    "zero3-fp32-no-clip-gas1": _case(_Z3, gas=1, **NO_CLIP),
    "zero3-bf16": _case(_zero3("bf16")),
    "zero3-fp16-gas1": _case(_zero3("fp16", needs_fp16=True), gas=1),
    "zero3-safe-full-grad": _case(_zero3(**_EVEN_SIZES), "safe_full_grad_between"),
    "zero3-optimizer-zero-grad-between": _case(_Z3, "optimizer_zero_grad_between"),
    "zero3-offload": _case(_offload3(optimizer={})),
    "zero3-offload-bf16-no-clip-gas1": _case(_offload3("bf16", optimizer={}), gas=1, **NO_CLIP),
    "zero3-offload-nvme": _case(_offload3(optimizer=NVME, extra={
        **CPU_ADAM,
        **AIO
    })),
    "zero3-offload-safe-full-grad": _case(_offload3(optimizer={}, **_EVEN_SIZES), "safe_full_grad_between"),
    "zero3-offload-optimizer-zero-grad-between": _case(_offload3(optimizer={}), "optimizer_zero_grad_between"),
    "zero3-offload-param": _case(_offload3(param={})),
    "zero3-offload-param-and-optimizer-gas1": _case(_offload3(param={}, optimizer={}), gas=1),
    # The writers of ZeRO-3 gradient partitions that bypass the base partition_grads() run only on CUDA GPUs: the
    # multi-GPU workflow runs these (skipped elsewhere). ZenFlow replaces partition_grads() and keeps its own fp32
    # gradients, SuperOffload overrides partition_grads() and step(), DeepCompile's compiled ops write the buffers.
    "zero3-zenflow": _case(_ZENFLOW3, needs_cuda=True),
    "zero3-superoffload": _case(_SUPEROFFLOAD3, needs_cuda=True),
    "zero3-deepcompile": _case(_DEEPCOMPILE3, "compiled", needs_cuda=True),
}

#: The case tables a reference run (``ds_harness.support.pristine``) computes, by name.
TABLES: dict[str, dict[str, Case]] = {"default": CASES, "every-gradient": EVERY_GRADIENT_CASES}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def fixed_run(name: str, workdir: str, table: str = "default") -> dict:
    """Train case ``name`` of ``TABLES[table]`` in managed mode; return digests of everything a user could observe.

    ``workdir`` is a folder all ranks share (checkpoints). An NVMe case on a machine where the async I/O
    op does not build returns ``{"skipped": reason}``.
    """
    case = TABLES[table][name]
    if case.needs_cuda and not torch.cuda.is_available():
        return {"skipped": "needs CUDA GPUs (the multi-GPU workflow runs it)"}
    if case.needs_aio and (reason := nvme_unavailable_reason()) is not None:
        return {"skipped": reason}
    engine = case.path.initialize(gas=case.gas, managed=None, **case.more)
    seen = _DRIVES[case.drive](engine, f"{workdir}/{name}", case.gas)
    result = {**_observe(engine), **(seen or {})}
    destroy(engine)
    return result


def _plain(engine, workdir: str, gas: int, steps: range = range(STEPS)) -> None:
    for step in steps:
        for i in range(gas):
            engine.backward(forward_loss(engine, step, i))
            engine.step()


def _zero_grad_between(engine, workdir: str, gas: int, optimizer: bool = False) -> None:
    """``zero_grad()`` (the engine's, or with ``optimizer`` the ZeRO optimizer's own) after the first micro-batch
    of every step: what it discards is up to DeepSpeed."""
    for step in range(STEPS):
        for i in range(gas):
            engine.backward(forward_loss(engine, step, i))
            engine.step()
            if i == 0:
                (engine.optimizer if optimizer else engine).zero_grad()


def _no_sync(engine, workdir: str, gas: int) -> None:
    """Every micro-batch but the last of a step inside ``no_sync()``."""
    for step in range(STEPS):
        for i in range(gas):
            loss = forward_loss(engine, step, i)
            if i < gas - 1:
                with engine.no_sync():
                    engine.backward(loss)
            else:
                engine.backward(loss)
            engine.step()


def _fp16_overflow(engine, workdir: str, gas: int) -> None:
    """One overflowing micro-batch in step 1: the step is skipped and the loss scale backs off."""
    for step in range(STEPS):
        for i in range(gas):
            loss = forward_loss(engine, step, i)
            engine.backward(loss * float("inf") if (step, i) == (1, 0) else loss)
            engine.step()


def _checkpoint(engine, workdir: str, gas: int) -> None:
    """Save after step 1, train on, load it back and train the last step again."""
    _plain(engine, workdir, gas, range(2))
    engine.save_checkpoint(workdir, tag="step2")
    _plain(engine, workdir, gas, range(2, STEPS))
    engine.load_checkpoint(workdir, tag="step2")
    _plain(engine, workdir, gas, range(2, STEPS))


def _compiled(engine, workdir: str, gas: int) -> None:
    """DeepCompile: the engine's ``compile()`` before the plain loop."""
    engine.compile()
    _plain(engine, workdir, gas)


def _safe_full_grad_between(engine, workdir: str, gas: int) -> dict:
    """After each step's boundary backward and before ``step()``, every parameter's full gradient read through
    ``deepspeed.utils.safe_get_full_grad`` and half of it written back with ``safe_set_full_grad``: user code
    (gradient surgery, custom clipping) that reads and writes the very partitions the bug fixes manage. Returns
    the digests of what it read."""
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    full_grads = {}
    for step in range(STEPS):
        for i in range(gas):
            engine.backward(forward_loss(engine, step, i))
            if i == gas - 1:
                for pname, p in engine.module.named_parameters():
                    grad = safe_get_full_grad(p)
                    full_grads[f"step {step} {pname}"] = None if grad is None else digest(grad)
                    if grad is not None:
                        safe_set_full_grad(p, grad * 0.5)
            engine.step()
    return {"full_grads": full_grads}


_DRIVES: dict[str, Callable[..., dict | None]] = {
    "plain": _plain,
    "zero_grad_between": _zero_grad_between,
    "optimizer_zero_grad_between": functools.partial(_zero_grad_between, optimizer=True),
    "no_sync": _no_sync,
    "fp16_overflow": _fp16_overflow,
    "checkpoint": _checkpoint,
    "safe_full_grad_between": _safe_full_grad_between,
    "compiled": _compiled,
}


def _observe(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    params = {}
    for pname, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p) if hasattr(p, "ds_id") else p
        params[pname] = digest(full)
    # Left out: the ZeRO state dict's DeepSpeed version string (it names the series), and ZeRO-3's flat
    # fp32 groups, whose alignment padding is uninitialised memory (their values are the params above).
    state = {
        path: digest(v) if isinstance(v, torch.Tensor) else repr(v)
        for path, v in flatten(engine.optimizer.state_dict())
        if "ds_version" not in path and "fp32_flat_groups" not in path
    }
    norm = engine.get_global_grad_norm()
    scale = engine._get_optimizer_loss_scale()
    return {
        "params": params,
        "optimizer_state": hashlib.sha256(repr(sorted(state.items())).encode()).hexdigest(),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "grad_norm": float(norm).hex() if norm is not None else None,
        "loss_scale": float(scale).hex() if scale is not None else None,
        "lr": [float(lr).hex() for lr in engine.get_lr()],
    }


def differences(got: dict, want: dict) -> list[str]:
    """What differs between two ``fixed_run`` results of one rank: each parameter and each full gradient read
    by name, then every other observed value."""
    out = [f"param {p}" for p in want["params"] if got["params"].get(p) != want["params"][p]]
    full_grads = want.get("full_grads", {})
    out += [f"full grad {g}" for g in full_grads if got.get("full_grads", {}).get(g) != full_grads[g]]
    return out + sorted(k for k in want if k not in ("params", "full_grads") and got.get(k) != want[k])
