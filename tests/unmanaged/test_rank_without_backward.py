"""ZeRO stages 2 and 3 reduce in every backward: a rank that calls step() with no backward while its peers ran one
gets a clear error at once, before any collective (its peers wait in their backward's reduction). Both series."""

import pytest

from ds_harness.support.paths import PATHS
from ds_harness.support.training import backward, destroy, forward_loss, snapshot

FLAG = "managed_gradient_accumulation"


def _rank_without_backward_body(path_name: str) -> dict:
    import deepspeed.comm as ds_comm

    engine = PATHS[path_name].initialize(gas=1, managed=False)
    if ds_comm.get_rank() != 0:
        # Waits in the reductions of backward (at stage 3 also the gathers of forward) until rank 0 joins them
        backward(engine, forward_loss(engine, 0, 0))
    else:
        with pytest.raises(RuntimeError, match=rf"{FLAG}=false but no backward.* since the previous step\(\) on "
                           rf"this rank"):
            engine.step()
        # Rank 0 joined no collective: its own forward and backward now meet the ones its peers wait in
        backward(engine, forward_loss(engine, 0, 0))
    engine.step()
    assert engine.was_step_applied()
    params = snapshot(engine).params
    destroy(engine)
    return params


@pytest.mark.world_size(2)
@pytest.mark.rank_timeout(240)
@pytest.mark.parametrize("path_name", [
    pytest.param("zero2-fp32", marks=pytest.mark.pr("zero-2", "unmanaged-step-checks")),
    pytest.param("zero3-fp32", marks=pytest.mark.pr("zero-3", "unmanaged-step-checks")),
])
def test_rank_without_backward_raises_before_any_collective(dist, path_name):
    params = dist.run(_rank_without_backward_body, path_name)
    # Every rank applied the same step afterwards
    for name, value in params[0].items():
        assert all(value.equal(other[name]) for other in params[1:]), name


def _rank_without_backward_contributes_zeros_body(path_name: str) -> bool:
    """Rank 0 runs no backward in the second step (no rank in the third): the same as a reference whose missing
    backward passes run on a zero loss."""
    import deepspeed.comm as ds_comm
    import torch

    plan = [[1, 1], [0, 1], [0, 0], [1, 2]]  # backward passes per step, per rank
    engines = [PATHS[path_name].initialize(gas=1, managed=False) for _ in "ab"]
    engine, reference = engines
    rank = ds_comm.get_rank()
    for step, counts in enumerate(plan):
        for i in range(max(counts)):
            if i < counts[rank]:
                backward(engine, forward_loss(engine, step, i))
                backward(reference, forward_loss(reference, step, i))
            else:
                backward(reference, forward_loss(reference, step, i) * 0)
        engine.step()
        reference.step()
    actual, expected = snapshot(engine).params, snapshot(reference).params
    destroy(*engines)
    return all(torch.equal(actual[name], expected[name]) for name in expected)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name", [
    pytest.param(name, marks=pytest.mark.pr("zero-offload" if name == "zero1-offload" else "zero-0-1",
                                            "unmanaged-step-checks"), id=name)
    for name in ("fp32-deepspeed-optimizer", "bf16", "zero1-fp32", "zero1-bf16-fp32-accumulation", "zero1-offload",
                 "zero1-branchy")
])
def test_at_zero_0_1_a_rank_without_backward_contributes_zeros(dist, path_name):
    """ZeRO stages 0 and 1: backward does not communicate, so a rank without backward (or with fewer) steps with its
    peers, contributing zero gradients: no collective decides it, and nothing desyncs."""
    assert dist.run(_rank_without_backward_contributes_zeros_body, path_name) == [True] * dist.world_size
