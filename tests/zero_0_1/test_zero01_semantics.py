"""PR 1: what unmanaged mode promises besides parity - boundary, bookkeeping, discard, checkpoints, overflow."""

import pytest

from support import scenarios
from support.paths import FP16_DYNAMIC, ZERO_0_1_PATHS

pytestmark = [pytest.mark.pr(1), pytest.mark.world_size(1, 2)]


@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero1-fp32", "zero1-bf16-fp32-accumulation"])
def test_boundary_is_true_only_while_step_runs(dist, path_name):
    dist.run(scenarios.boundary_only_during_step, path_name)


@pytest.mark.parametrize("path_name,torch_style", [("fp32-deepspeed-optimizer", False), ("zero1-fp32", False),
                                                   ("zero1-fp32", True), ("bf16", False)])
def test_bookkeeping_counts_steps_and_backward_passes(dist, path_name, torch_style):
    dist.run(scenarios.bookkeeping, path_name, torch_style)


def test_torch_style_backward_accumulates_like_engine_backward(dist):
    dist.run(scenarios.torch_style_backward_parity, "zero1-fp32")


@pytest.mark.parametrize("path_name", sorted(ZERO_0_1_PATHS))
def test_zero_grad_discards_a_partial_accumulation(dist, path_name):
    dist.run(scenarios.zero_grad_discards, path_name)


@pytest.mark.parametrize("path_name", [p for p in FP16_DYNAMIC if p in ZERO_0_1_PATHS])
def test_fp16_overflow_skips_the_step_and_clears_the_accumulation(dist, path_name):
    dist.run(scenarios.fp16_overflow_inside_accumulation, path_name)


@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "bf16", "zero1-fp32", "zero1-bf16-fp32-accumulation",
                                       "fp16-unfused", "moe"])
def test_checkpoint_round_trip_reproduces_an_uninterrupted_run(dist, path_name, tmp_path):
    dist.run(scenarios.checkpoint_round_trip, path_name, str(tmp_path))
