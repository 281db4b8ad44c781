"""`zero-0-1`, `zero-2`, `zero-3`: N backwards + one step() in unmanaged mode equals managed accumulation, bitwise, on
every path.

Each configuration (ds_harness.support.paths) is a case marked with the PR that brings its ZeRO stage.
"""

import pytest
import torch

from ds_harness.support import scenarios
from ds_harness.support.cases import cases
from ds_harness.support.paths import MICS_PATHS, ZERO_0_1_PATHS, ZERO_2_PATHS, ZERO_3_PATHS

ALL = sorted(ZERO_0_1_PATHS) + sorted(ZERO_2_PATHS) + sorted(ZERO_3_PATHS)
FULL_BATCH = ["fp32-deepspeed-optimizer", "zero1-fp32", "zero2-fp32", "zero2-overlap-comm", "zero2-all-reduce",
              "zero3-fp32", "zero3-no-overlap-comm", "zero3-small-buckets"]


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("path_name", cases(*ALL))
def test_n_backwards_then_step_equals_managed_gas_n(dist, path_name, n):
    dist.run(scenarios.fixed_n_parity, path_name, n)


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("path_name", cases(*ALL))
def test_variable_n_equals_boundary_driven_managed_engine(dist, path_name):
    dist.run(scenarios.variable_n_parity, path_name, [1, 3, 2, 5])


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("path_name", cases(*FULL_BATCH))
def test_variable_n_matches_a_full_batch_pytorch_reference(dist, path_name):
    dist.run(scenarios.full_batch_reference, path_name, [1, 3, 2, 5])


@pytest.mark.base("0.19.3", reason="DeepSpeed 0.19.8 removed MiCS")
@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name", cases(*MICS_PATHS))
@pytest.mark.skipif(not torch.cuda.is_available(), reason="MiCS needs coalesced collectives, which gloo lacks")
def test_mics_equals_managed(dist, path_name):
    dist.run(scenarios.fixed_n_parity, path_name, 3)
    dist.run(scenarios.variable_n_parity, path_name, [1, 3, 2])
