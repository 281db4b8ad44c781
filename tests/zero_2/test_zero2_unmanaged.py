"""PR 2: ZeRO stage 2 reduces on every backward and finalizes in step(); parity, discard, checkpoints, errors."""

import pytest

from support import scenarios
from support.paths import FP16_DYNAMIC, ZERO_2_PATHS

pytestmark = pytest.mark.pr(2)
PATH_NAMES = sorted(ZERO_2_PATHS)


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("path_name", PATH_NAMES)
def test_n_backwards_then_step_equals_managed_gas_n(dist, path_name, n):
    dist.run(scenarios.fixed_n_parity, path_name, n)


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("path_name", PATH_NAMES)
def test_variable_n_equals_boundary_driven_managed_engine(dist, path_name):
    dist.run(scenarios.variable_n_parity, path_name, [1, 3, 2, 5])


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("path_name", ["zero2-fp32", "zero2-overlap-comm", "zero2-all-reduce"])
def test_variable_n_matches_a_full_batch_pytorch_reference(dist, path_name):
    dist.run(scenarios.full_batch_reference, path_name, [1, 3, 2, 5])


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", PATH_NAMES)
def test_zero_grad_discards_a_partial_accumulation(dist, path_name):
    dist.run(scenarios.zero_grad_discards, path_name)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", [p for p in FP16_DYNAMIC if p in ZERO_2_PATHS])
def test_fp16_overflow_skips_the_step_and_clears_the_accumulation(dist, path_name):
    dist.run(scenarios.fp16_overflow_inside_accumulation, path_name)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["zero2-fp32", "zero2-overlap-comm", "zero2-bf16"])
def test_checkpoint_round_trip_reproduces_an_uninterrupted_run(dist, path_name, tmp_path):
    dist.run(scenarios.checkpoint_round_trip, path_name, str(tmp_path))


@pytest.mark.world_size(1, 2)
def test_boundary_and_bookkeeping(dist):
    dist.run(scenarios.boundary_only_during_step, "zero2-fp32")
    dist.run(scenarios.bookkeeping, "zero2-fp32", False)
    dist.run(scenarios.bookkeeping, "zero2-fp32", True)


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("path_name", ["zero2-wide", "zero2-wide-overlap-comm"])
def test_gradient_memory_held_across_backwards_equals_managed(dist, path_name):
    from support.memory_assertions import assert_same_gradient_memory

    managed = dist.run(scenarios.gradient_bytes_held_across_backwards, path_name, True, 4)
    unmanaged = dist.run(scenarios.gradient_bytes_held_across_backwards, path_name, False, 4)
    assert_same_gradient_memory(managed, unmanaged, bucket_bytes=4 * 20000)
