"""PR 3: ZeRO stage 3 reduces and partitions on every backward; parity, discard, checkpoints."""

import pytest
import torch

from support import scenarios
from support.paths import FP16_DYNAMIC, ZERO_3_PATHS

pytestmark = pytest.mark.pr(3)
PATH_NAMES = sorted(ZERO_3_PATHS)


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
@pytest.mark.parametrize("path_name", ["zero3-fp32", "zero3-no-overlap-comm", "zero3-small-buckets"])
def test_variable_n_matches_a_full_batch_pytorch_reference(dist, path_name):
    dist.run(scenarios.full_batch_reference, path_name, [1, 3, 2, 5])


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", PATH_NAMES)
def test_zero_grad_discards_a_partial_accumulation(dist, path_name):
    dist.run(scenarios.zero_grad_discards, path_name)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", [p for p in FP16_DYNAMIC if p in ZERO_3_PATHS])
def test_fp16_overflow_skips_the_step_and_clears_the_accumulation(dist, path_name):
    dist.run(scenarios.fp16_overflow_inside_accumulation, path_name)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["zero3-fp32", "zero3-persistent-and-partitioned", "zero3-bf16"])
def test_checkpoint_round_trip_reproduces_an_uninterrupted_run(dist, path_name, tmp_path):
    dist.run(scenarios.checkpoint_round_trip, path_name, str(tmp_path))


@pytest.mark.world_size(1, 2)
def test_boundary_and_bookkeeping(dist):
    dist.run(scenarios.boundary_only_during_step, "zero3-fp32")
    dist.run(scenarios.bookkeeping, "zero3-fp32", False)
    dist.run(scenarios.bookkeeping, "zero3-fp32", True)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["zero3-fp32", "zero3-bf16"])
def test_16bit_model_export_after_unmanaged_steps(dist, path_name, tmp_path):
    dist.run(scenarios.sixteen_bit_export_parity, path_name, str(tmp_path))


@pytest.mark.world_size(2, 4)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="MiCS needs coalesced collectives, which gloo lacks")
def test_mics_equals_managed_gas_n(dist):
    dist.run(scenarios.fixed_n_parity, "zero3-mics", 3)
    dist.run(scenarios.variable_n_parity, "zero3-mics", [1, 3, 2])


@pytest.mark.world_size(1, 2, 4)
def test_gradient_memory_held_across_backwards_equals_managed(dist):
    from support.memory_assertions import assert_same_gradient_memory

    managed = dist.run(scenarios.gradient_bytes_held_across_backwards, "zero3-wide", True, 4)
    unmanaged = dist.run(scenarios.gradient_bytes_held_across_backwards, "zero3-wide", False, 4)
    assert_same_gradient_memory(managed, unmanaged, bucket_bytes=4 * 20000)
