"""A fixed training run whose result pristine DeepSpeed 0.19.3 recorded (tests/fixtures/default_behaviour.json).

With ``managed_gradient_accumulation`` absent the series must not change a single bit of what DeepSpeed
computes. ``tools/record_reference.py`` runs these configurations on the pristine sdist; the test runs
them on the installed, patched DeepSpeed and compares digests of every parameter and of the optimizer
state, plus the step bookkeeping.
"""

from __future__ import annotations

import hashlib

import torch

from .paths import SEQUENTIAL_GATHERS_ON_GLOO
from .training import base_config, flatten, initialize, run_managed

STEPS = 3
GAS = 2

#: Configurations without the flag: every ZeRO stage, fp32 and bf16, DeepSpeed's default clipping.
CONFIGS = {
    "zero0-fp32": dict(stage=0),
    "zero0-bf16": dict(stage=0, dtype="bf16"),
    "zero1-fp32": dict(stage=1),
    "zero1-bf16": dict(stage=1, dtype="bf16"),
    "zero2-fp32": dict(stage=2),
    "zero2-bf16-overlap": dict(stage=2, dtype="bf16", zero_optimization={"overlap_comm": True}),
    "zero3-fp32": dict(stage=3, zero_optimization={"stage3_param_persistence_threshold": 0}),
    # Sequential gathers (see SEQUENTIAL_GATHERS_ON_GLOO; the fixture is recorded on gloo too).
    "zero3-bf16": dict(stage=3, dtype="bf16", zero_optimization=SEQUENTIAL_GATHERS_ON_GLOO),
}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


_warmed_up = False


def _warm_up() -> None:
    """Train one throw-away engine first in every process.

    Measured on pristine 0.19.3: a ZeRO-3 bf16 engine that is the very first engine of its process
    computes a slightly different result than one created after any other engine, so the fixed runs
    must not depend on whether a test rank is fresh.
    """
    global _warmed_up
    if not _warmed_up:
        engine = initialize(base_config(1))
        run_managed(engine, [1])
        engine.destroy()
        _warmed_up = True


def fixed_run(name: str) -> dict:
    """Train ``name`` for STEPS managed steps of GAS micro-batches; return digests of the result."""
    from deepspeed.utils import safe_get_full_fp32_param

    _warm_up()

    options = dict(CONFIGS[name])
    config = base_config(GAS, **options)
    config.pop("gradient_clipping")  # the default (1.0) is part of the default behaviour
    engine = initialize(config)
    run_managed(engine, [GAS] * STEPS)
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
    result = {
        "params": params,
        "optimizer_state": hashlib.sha256(repr(sorted(state.items())).encode()).hexdigest(),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "grad_norm": float(norm).hex() if norm is not None else None,
        "lr": [float(lr).hex() for lr in engine.get_lr()],
    }
    engine.destroy()
    return result
