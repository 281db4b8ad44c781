"""Random step plans: unmanaged mode trains what managed mode or plain PyTorch trains, on every ZeRO stage.

Hypothesis draws a plan of logical steps. Each step has 1..6 backward passes; each backward uses the
first head, the second, or both of a two-headed model, so a head can get no gradient for a whole step;
an fp32 step may discard its partial accumulation with ``zero_grad()`` and start again; after a step the
engine may be saved, destroyed and resumed from the checkpoint. Gradient clipping is on or off; fp32 or
bf16; every ZeRO stage, with and without CPU optimizer offload; 2 ranks.

The reference:
- the same N in every step and no discard: a managed engine with ``gradient_accumulation_steps = N``,
  bitwise;
- a varying N in bf16: a managed engine driven by ``set_gradient_accumulation_boundary()``, bitwise;
- otherwise (fp32): single-process plain PyTorch over every rank's kept micro-batches, with
  ``torch.optim.AdamW``, ``clip_grad_norm_`` and a zero gradient for a parameter no kept backward
  touched (DeepSpeed steps such a parameter with a zero gradient).

The default example count keeps CI short and is derandomised (the same plans every run);
``DS_SERIES_PROPERTY_EXAMPLES=200 DS_SERIES_PROPERTY_SEED=random`` searches further (CONTRIBUTING.md).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from ds_harness import run_on_ranks
from ds_harness.support import pytorch_reference
from ds_harness.support.paths import Path, make_two_head_model
from ds_harness.support.training import assert_identical, assert_params_close, destroy, loss_fn, micro_batch, snapshot

pytestmark = pytest.mark.pr("zero-offload")

WORLD_SIZE = 2
LR = 1e-2
WEIGHT_DECAY = 0.01
CLIP = 0.05
EXAMPLES = int(os.environ.get("DS_SERIES_PROPERTY_EXAMPLES", "4"))
RANDOM = os.environ.get("DS_SERIES_PROPERTY_SEED", "") == "random"
HEADS = ("a", "b", "ab")

# ----------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------


@st.composite
def steps(draw: st.DrawFn, fp32: bool) -> dict[str, Any]:
    heads = draw(st.lists(st.sampled_from(HEADS), min_size=1, max_size=6))
    discard = None
    if fp32 and draw(st.booleans()):
        # zero_grad() after these backwards, then 1..3 more that the step keeps
        discard = len(heads)
        heads = heads + draw(st.lists(st.sampled_from(HEADS), min_size=1, max_size=3))
    return {"heads": heads, "discard_after": discard, "checkpoint": draw(st.booleans())}


@st.composite
def cases(draw: st.DrawFn, stage: int, offload: bool) -> tuple[dict, list]:
    dtype = draw(st.sampled_from(["fp32", "bf16"]))
    spec = {"stage": stage, "offload": offload, "dtype": dtype, "clip": draw(st.booleans())}
    plan = draw(st.lists(steps(dtype == "fp32"), min_size=1, max_size=3))
    return spec, plan


# ----------------------------------------------------------------------------------------------
# On the ranks
# ----------------------------------------------------------------------------------------------


def _path(spec: dict) -> Path:
    zero: dict[str, Any] = {}
    if spec["offload"]:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if spec["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    extra = {"gradient_clipping": CLIP if spec["clip"] else 0.0, "zero_optimization": zero}
    return Path(spec["stage"], spec["dtype"], extra, model_fn=make_two_head_model)


def _loss(engine, step: int, index: int, use: str) -> torch.Tensor:
    engine.module.use = use
    dtype = next(engine.module.parameters()).dtype
    x, y = micro_batch(step, index, dtype=dtype)
    return loss_fn(engine(x.to(engine.device)), y.to(engine.device))


def _kept(step_plan: dict) -> list[int]:
    start = 0 if step_plan["discard_after"] is None else step_plan["discard_after"]
    return list(range(start, len(step_plan["heads"])))


def _run_unmanaged(spec: dict, plan: list, gas: int, save_dir: str):
    """The plan on an unmanaged engine; with gas > 1 the engine scales each loss, else the caller does."""
    path = _path(spec)
    engine = path.initialize(gas=gas, managed=False)
    for step, step_plan in enumerate(plan):
        n = len(_kept(step_plan))
        for i, use in enumerate(step_plan["heads"]):
            loss = _loss(engine, step, i, use)
            engine.backward(loss if gas > 1 else loss / n, scale_wrt_gas=gas > 1)
            if i + 1 == step_plan["discard_after"]:
                engine.zero_grad()
        engine.step()
        if step_plan["checkpoint"]:
            engine.save_checkpoint(save_dir, tag=f"step{step}")
            destroy(engine)
            engine = path.initialize(gas=gas, managed=False)
            engine.load_checkpoint(save_dir, tag=f"step{step}")
    assert engine.global_steps == len(plan)
    result = snapshot(engine)
    destroy(engine)
    return result


def _run_managed(spec: dict, plan: list, gas: int):
    """Managed mode: GAS = N for a constant N, else the boundary toggled by hand per backward."""
    engine = _path(spec).initialize(gas=gas, managed=True)
    for step, step_plan in enumerate(plan):
        n = len(step_plan["heads"])
        for i, use in enumerate(step_plan["heads"]):
            if gas == 1:
                engine.set_gradient_accumulation_boundary(i == n - 1)
                engine.backward(_loss(engine, step, i, use) / n, scale_wrt_gas=False)
            else:
                engine.backward(_loss(engine, step, i, use))
            engine.step()
    result = snapshot(engine)
    destroy(engine)
    return result


def _plain_pytorch(spec: dict, plan: list) -> dict[str, torch.Tensor]:
    """Every rank's kept micro-batches of a step as one mean loss, stepped by torch.optim.AdamW."""

    def use_heads(model: torch.nn.Module, step: int, index: int) -> None:
        model.use = plan[step]["heads"][index]

    return pytorch_reference.run(make_two_head_model, [_kept(s) for s in plan],
                                 WORLD_SIZE,
                                 CLIP if spec["clip"] else 0.0,
                                 prepare=use_heads)


def check_plan(spec: dict, plan: list, save_dir: str) -> None:
    # An engine just resumed from a checkpoint has not stepped yet: it reports no last step.
    ignore = {"was_step_applied", "grad_norm"} if plan[-1]["checkpoint"] else set()
    sizes = {len(s["heads"]) for s in plan}
    constant_n = len(sizes) == 1 and all(s["discard_after"] is None for s in plan)
    if constant_n:
        n = sizes.pop()
        actual = _run_unmanaged(spec, plan, n, save_dir)
        assert_identical(_run_managed(spec, plan, n), actual, f"{spec} plan {plan} vs managed GAS={n}", ignore)
    elif spec["dtype"] == "bf16":
        actual = _run_unmanaged(spec, plan, 1, save_dir)
        expected = _run_managed(spec, plan, 1)
        assert_identical(expected, actual, f"{spec} plan {plan} vs boundary-driven managed",
                         ignore | {"global_samples"})
    else:
        actual = _run_unmanaged(spec, plan, 1, save_dir)
        assert_params_close(actual.params,
                            _plain_pytorch(spec, plan),
                            f"{spec} plan {plan} vs plain PyTorch",
                            rtol=1e-5,
                            atol=1e-6)


# ----------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------

CONFIGURATIONS = [(0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]


@pytest.mark.parametrize("stage, offload",
                         [pytest.param(s, o, id=f"zero{s}{'-offload' if o else ''}") for s, o in CONFIGURATIONS])
def test_random_step_plans_match_the_reference(stage, offload, tmp_path_factory):

    fp32_clipped = {"stage": stage, "offload": offload, "dtype": "fp32", "clip": True}

    def step(heads: list, discard_after: int | None = None, checkpoint: bool = False) -> dict:
        return {"heads": heads, "discard_after": discard_after, "checkpoint": checkpoint}

    # Always walked, whatever is drawn: a head without gradient for a whole step under clipping (against
    # managed GAS=2, then against plain PyTorch with a varying N), a discard, and a resume.
    @example(case=(fp32_clipped, [step(["a", "a"], checkpoint=True), step(["b", "b"]), step(["ab", "a"])]))
    @example(
        case=(fp32_clipped,
              [step(["a"]), step(["b", "a", "b"], discard_after=1),
               step(["ab", "b"], checkpoint=True)]))
    @settings(max_examples=max(EXAMPLES, 1),
              deadline=None,
              derandomize=not RANDOM,
              database=None,
              phases=list(Phase) if RANDOM else [Phase.explicit, Phase.generate][:1 + bool(EXAMPLES)],
              suppress_health_check=list(HealthCheck))
    @given(case=cases(stage, offload))
    def check(case):
        spec, plan = case
        save_dir = str(tmp_path_factory.mktemp("checkpoints"))
        run_on_ranks(check_plan, WORLD_SIZE, spec, plan, save_dir, timeout=600)

    check()
