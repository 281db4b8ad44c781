"""fix-zero3-stale-grad-partitions: ZeRO-3 knows which gradient partitions each step wrote.

The fix zeroes at ``step()`` only the gradient partitions an earlier step wrote and this one did not, and its
writers copy a partition's first gradient of a step over the buffer instead of adding to it, so that where every
parameter gets a gradient in every step nothing is zeroed at all. A bookkeeping that forgets a write, a step or a
reset gives a parameter an earlier step's gradient (or loses this step's) in exactly the schedules below.

Head b of a two-head model gets a gradient in step 0, its first one of step 1 in the second micro-batch, none in
steps 2 and 3, and one only in the first micro-batch of step 4 (so with optimizer offload the boundary backward
does not reach it). Its full gradient read with ``safe_get_full_grad()`` before each ``step()`` must be what an
engine that never ran the earlier steps reads for the same micro-batches: zero where the step gave it none. The
learning rate is 0, so the weights, and with them every micro-batch's gradient, are the same in every engine.
"""

import pytest

from ds_harness.support.paths import make_two_head_model, plain_sgd, zero3_paths

pytestmark = pytest.mark.pr("fix-zero3-stale-grad-partitions")

PATHS = zero3_paths(plain_sgd(0.0), make_two_head_model)
#: Unmanaged mode: a promise of zero-offload on 0.19.3 (its last unmanaged PR); on 0.19.8, whose flag is upstream's,
#: of the fix PR.
_UNMANAGED = pytest.mark.pr("zero-offload", "fix-zero3-stale-grad-partitions")
#: The unmanaged engine.zero_grad() discard: zero-3 and zero-offload on 0.19.3, its own PR on 0.19.8.
_DISCARD = pytest.mark.pr("zero-offload", "unmanaged-zero-grad-discard")
#: The heads each micro-batch of each step uses.
SCHEDULE = [("ab", "ab"), ("a", "ab"), ("a", "a"), ("a", "a"), ("b", "a")]


def _head_b_gradients(path_name: str, managed: bool, steps: range, *, discard_first: bool = False) -> list[dict]:
    """Run ``steps`` of SCHEDULE on a fresh engine, managed (GAS 2) or unmanaged (2 backward passes per step()),
    and return head b's full gradients read before each step(). With ``discard_first``, each step's first backward
    is discarded (unmanaged ``engine.zero_grad()``) before the second one."""
    from deepspeed.utils import safe_get_full_grad

    from ds_harness.support.training import destroy, forward_loss

    engine = PATHS[path_name].initialize(gas=2 if managed else 1, managed=None if managed else False)
    reads = []
    for step in steps:
        for i, use in enumerate(SCHEDULE[step]):
            engine.module.use = use
            engine.backward(forward_loss(engine, step, i))
            if i == 0 and discard_first:
                engine.zero_grad()
            if i == 0 and managed:
                engine.step()  # not the boundary: accumulates
        reads.append({name: safe_get_full_grad(p).clone() for name, p in engine.module.head_b.named_parameters()})
        engine.step()
    destroy(engine)
    return reads


def _each_step_reads_its_own_gradient(path_name: str, managed: bool) -> None:
    import torch

    reads = _head_b_gradients(path_name, managed, range(len(SCHEDULE)))
    for step, uses in enumerate(SCHEDULE):
        if step == 0:
            continue
        if any("b" in use for use in uses):
            expected = _head_b_gradients(path_name, managed, range(step, step + 1))[0]
        else:
            expected = {name: torch.zeros_like(grad) for name, grad in reads[step].items()}
        for name, grad in reads[step].items():
            if any("b" in use for use in uses):
                assert expected[name].any(), f"{path_name}: step {step} gave head_b.{name} no gradient"
            assert torch.equal(grad, expected[name]), (
                f"{path_name}, {'managed' if managed else 'unmanaged'}, step {step} (heads {uses}): head_b.{name} "
                f"read a gradient off by {(grad - expected[name]).abs().max().item():g} from its own")


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", sorted(PATHS))
def test_each_step_reads_only_its_own_gradient(dist, path_name):
    dist.run(_each_step_reads_its_own_gradient, path_name, True)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", [pytest.param(name, marks=_UNMANAGED) for name in sorted(PATHS)])
def test_unmanaged_each_step_reads_only_its_own_gradient(dist, path_name):
    dist.run(_each_step_reads_its_own_gradient, path_name, False)


def _discarded_gradient_is_gone(path_name: str) -> None:
    """Steps 0 and 1 of SCHEDULE unmanaged, each step's first backward discarded: in step 1 head b's gradient is
    the second backward's alone, in step 0 likewise; step 2 (head a only) reads zero."""
    import torch

    discarded = _head_b_gradients(path_name, False, range(3), discard_first=True)
    for step in range(3):
        # The second backward alone, on an engine that never saw the first
        expected = _head_b_gradients(path_name, False, range(step, step + 1), discard_first=True)[0]
        for name, grad in discarded[step].items():
            assert torch.equal(grad, expected[name]), (
                f"{path_name}: step {step}: head_b.{name} kept a discarded or earlier gradient (off by "
                f"{(grad - expected[name]).abs().max().item():g})")
    assert not any(grad.any() for grad in discarded[2].values()), f"{path_name}: step 2 gave head b no gradient"


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", [pytest.param(name, marks=_DISCARD) for name in sorted(PATHS)])
def test_unmanaged_discarded_gradient_is_gone(dist, path_name):
    dist.run(_discarded_gradient_is_gone, path_name)
