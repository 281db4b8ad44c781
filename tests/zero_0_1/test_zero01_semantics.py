"""PR 1: what unmanaged mode promises besides parity - boundary, bookkeeping, discard, checkpoints, overflow."""

import pytest
import torch

from support.paths import ZERO_0_1_PATHS
from support.training import (MICRO_BATCH, assert_identical, backward, destroy, forward_loss, run_managed,
                              run_unmanaged, snapshot)

pytestmark = pytest.mark.pr(1)

FP16_DYNAMIC = ["fp16-fused", "fp16-unfused", "zero1-fp16"]


def _boundary_body(path_name: str) -> None:
    path = ZERO_0_1_PATHS[path_name]
    seen = []

    class RecordingScheduler(torch.optim.lr_scheduler.LambdaLR):

        def step(self, *args, **kwargs):
            seen.append(engine.is_gradient_accumulation_boundary())
            if getattr(self, "fail", False):
                raise RuntimeError("scheduler failure")
            return super().step(*args, **kwargs)

    engine = path.initialize(gas=2, managed=False, scheduler=None)
    engine.lr_scheduler = RecordingScheduler(engine.optimizer if not hasattr(engine.optimizer, "optimizer") else
                                             engine.optimizer.optimizer, lambda _: 1.0)
    seen.clear()  # LambdaLR steps once on construction
    assert not engine.is_gradient_accumulation_boundary()
    run_unmanaged(engine, [2, 1])  # asserts the boundary is false during and after every backward and step
    assert seen == [True, True]

    engine.lr_scheduler.fail = True
    backward(engine, forward_loss(engine, 5, 0))
    with pytest.raises(RuntimeError, match="scheduler failure"):
        engine.step()
    assert not engine.is_gradient_accumulation_boundary()
    assert not engine.optimizer.is_gradient_accumulation_boundary
    destroy(engine)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero1-fp32", "zero1-bf16-fp32-accumulation"])
def test_boundary_is_true_only_while_step_runs(dist, path_name):
    dist.run(_boundary_body, path_name)


def _bookkeeping_body(path_name: str, torch_style: bool) -> None:
    import deepspeed.comm as ds_comm

    path = ZERO_0_1_PATHS[path_name]
    engine = path.initialize(gas=2, managed=False, steps_per_print=1)
    reports = []
    engine._report_progress = lambda step: reports.append(step)
    plan = [1, 3, 2]
    run_unmanaged(engine, plan, torch_style=torch_style)
    assert engine.global_steps == len(plan)
    assert engine.global_samples == MICRO_BATCH * ds_comm.get_world_size() * sum(plan)
    assert engine.was_step_applied()
    assert engine.lr_scheduler.last_batch_iteration == len(plan) - 1  # WarmupLR steps once per update
    # steps_per_print keys on step(), not on micro-steps (rank 0 reports)
    assert reports == ([1, 2, 3] if ds_comm.get_rank() == 0 else [])
    assert engine.tput_timer.global_step_count == len(plan)
    destroy(engine)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name,torch_style", [("fp32-deepspeed-optimizer", False), ("zero1-fp32", False),
                                                   ("zero1-fp32", True), ("bf16", False)])
def test_bookkeeping_counts_steps_and_backward_passes(dist, path_name, torch_style):
    dist.run(_bookkeeping_body, path_name, torch_style)


def _torch_style_parity_body(path_name: str) -> None:
    path = ZERO_0_1_PATHS[path_name]
    engine_api = path.initialize(gas=3, managed=False)
    run_unmanaged(engine_api, [3, 1, 2])
    expected = snapshot(engine_api)
    destroy(engine_api)
    torch_api = path.initialize(gas=3, managed=False)
    run_unmanaged(torch_api, [3, 1, 2], torch_style=True)
    assert_identical(expected, snapshot(torch_api), "engine.scale(loss).backward() vs engine.backward(loss)")
    destroy(torch_api)


@pytest.mark.world_size(1, 2)
def test_torch_style_backward_accumulates_like_engine_backward(dist):
    dist.run(_torch_style_parity_body, "zero1-fp32")


def _discard_body(path_name: str) -> None:
    path = ZERO_0_1_PATHS[path_name]
    reference = path.initialize(gas=2, managed=False)
    run_unmanaged(reference, [2, 2])
    expected = snapshot(reference)
    destroy(reference)

    engine = path.initialize(gas=2, managed=False)
    run_unmanaged(engine, [2])
    for i in range(3):  # a partial accumulation on other data, then discarded
        backward(engine, forward_loss(engine, 99, i))
    engine.zero_grad()
    with pytest.raises(RuntimeError, match="no backward"):
        engine.step()  # the discarded backward passes are not pending any more
    run_unmanaged(engine, [2], first_step=1)
    assert_identical(expected, snapshot(engine), f"{path_name}: zero_grad() must discard the partial accumulation")
    destroy(engine)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", sorted(ZERO_0_1_PATHS))
def test_zero_grad_discards_a_partial_accumulation(dist, path_name):
    dist.run(_discard_body, path_name)


def _overflow_body(path_name: str) -> None:
    path = ZERO_0_1_PATHS[path_name]

    def drive(engine, managed: bool) -> list:
        states = []
        for step in range(3):
            for i in range(3):
                loss = forward_loss(engine, step, i)
                if step == 1 and i == 1:
                    loss = loss * float("inf")  # one overflowing micro-batch inside the accumulation
                backward(engine, loss)
                if managed:
                    engine.step()
            if not managed:
                engine.step()
            states.append(snapshot(engine))
        return states

    # No LR warm-up here: its first LR is 0, which would hide whether the step after the skip trains.
    managed = path.initialize(gas=3, managed=True, scheduler=None)
    expected = drive(managed, True)
    destroy(managed)
    unmanaged = path.initialize(gas=3, managed=False, scheduler=None)
    actual = drive(unmanaged, False)
    destroy(unmanaged)

    for e, a in zip(expected, actual):
        assert_identical(e, a, f"{path_name} with an overflow at step 1")
    before, skipped, after = actual
    assert not skipped.scalars["was_step_applied"] and skipped.scalars["skipped_steps"] == 1
    assert skipped.scalars["loss_scale"] < before.scalars["loss_scale"]
    assert all(torch.equal(before.params[k], skipped.params[k]) for k in before.params), "skipped step changed params"
    assert after.scalars["was_step_applied"]
    assert any(not torch.equal(skipped.params[k], after.params[k]) for k in after.params), "next step did not train"


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", FP16_DYNAMIC)
def test_fp16_overflow_skips_the_step_and_clears_the_accumulation(dist, path_name):
    dist.run(_overflow_body, path_name)


def _checkpoint_body(path_name: str, save_dir: str) -> None:
    path = ZERO_0_1_PATHS[path_name]
    plan = [2, 3, 1, 2]
    uninterrupted = path.initialize(gas=2, managed=False)
    run_unmanaged(uninterrupted, plan)
    expected = snapshot(uninterrupted)
    destroy(uninterrupted)

    first = path.initialize(gas=2, managed=False)
    run_unmanaged(first, plan[:2])
    backward(first, forward_loss(first, 2, 0))
    with pytest.raises(RuntimeError, match=r"1 backward pass\(es\)"):
        first.save_checkpoint(save_dir, tag="pending")
    first.zero_grad()
    first.save_checkpoint(save_dir, tag="resume")
    destroy(first)

    resumed = path.initialize(gas=2, managed=False)
    resumed.load_checkpoint(save_dir, tag="resume")
    run_unmanaged(resumed, plan[2:], first_step=2)
    assert_identical(expected, snapshot(resumed), f"{path_name}: load_checkpoint() then training on")
    destroy(resumed)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "bf16", "zero1-fp32", "zero1-bf16-fp32-accumulation",
                                       "fp16-unfused", "moe"])
def test_checkpoint_round_trip_reproduces_an_uninterrupted_run(dist, path_name, tmp_path):
    dist.run(_checkpoint_body, path_name, str(tmp_path))
