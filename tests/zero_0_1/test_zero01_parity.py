"""PR 1: unmanaged accumulation equals managed accumulation bitwise on every stage 0/1 optimizer path."""

import pytest

from support import scenarios
from support.paths import ZERO_0_1_PATHS

pytestmark = pytest.mark.pr(1)
PATH_NAMES = sorted(ZERO_0_1_PATHS)


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
@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero1-fp32"])
def test_variable_n_matches_a_full_batch_pytorch_reference(dist, path_name):
    dist.run(scenarios.full_batch_reference, path_name, [1, 3, 2, 5])
