"""PR 1: unmanaged accumulation is bitwise identical to managed accumulation on every stage 0/1 path."""

import deepspeed.comm as ds_comm
import pytest

from support.paths import ZERO_0_1_PATHS
from support.training import (MICRO_BATCH, assert_identical, destroy, run_boundary_driven, run_managed, run_unmanaged,
                              snapshot)

pytestmark = pytest.mark.pr(1)

STEPS = 3


def _fixed_n_body(path_name: str, n: int) -> None:
    path = ZERO_0_1_PATHS[path_name]
    managed = path.initialize(gas=n, managed=True)
    run_managed(managed, [n] * STEPS)
    expected = snapshot(managed)
    destroy(managed)

    unmanaged = path.initialize(gas=n, managed=False)
    run_unmanaged(unmanaged, [n] * STEPS)
    assert unmanaged.global_steps == STEPS
    assert_identical(expected, snapshot(unmanaged), f"{path_name}, N={n}")
    destroy(unmanaged)


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("path_name", sorted(ZERO_0_1_PATHS))
def test_n_backwards_then_step_equals_managed_gas_n(dist, path_name, n):
    dist.run(_fixed_n_body, path_name, n)


def _variable_n_body(path_name: str, plan: list) -> None:
    path = ZERO_0_1_PATHS[path_name]
    managed = path.initialize(gas=1, managed=True)
    run_boundary_driven(managed, plan)
    expected = snapshot(managed)
    destroy(managed)

    unmanaged = path.initialize(gas=1, managed=False)
    run_unmanaged(unmanaged, plan, divide_by_n=True)
    # A boundary-driven managed engine counts train_batch_size per step whatever N was; unmanaged counts
    # the samples of every backward pass.
    actual = snapshot(unmanaged)
    assert actual.scalars["global_samples"] == MICRO_BATCH * ds_comm.get_world_size() * sum(plan)
    assert_identical(expected, actual, f"{path_name}, plan {plan}", ignore={"global_samples"})
    destroy(unmanaged)


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("path_name", sorted(ZERO_0_1_PATHS))
def test_variable_n_equals_boundary_driven_managed_engine(dist, path_name):
    dist.run(_variable_n_body, path_name, [1, 3, 2, 5])
