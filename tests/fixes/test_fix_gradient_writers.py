"""The stale-gradient fixes keep every other writer of a gradient partition working.

``fix-zero3-stale-grad-partitions`` and ``fix-zero-offload-stale-grads`` clear the gradients once ``step()`` has
used them, instead of zeroing at the next ``step()`` what the base backward path did not record. So a gradient
written some other way before ``step()`` is what the optimizer steps on. ``safe_set_full_grad()`` is the writer that
runs on CPU: set on a parameter that got no gradient in the step (its head was not used), the value must drive the
update, at every stage and with optimizer offload, as it does in DeepSpeed 0.19.3. (An earlier version of the fixes
zeroed it.) Set after the boundary backward on parameters that got a gradient in it, the value must replace that
gradient, with optimizer offload too (step() finishes only what that backward left pending). The update is plain
SGD with lr 0.5 and a set gradient of 0.25, so the expected parameter is exact. The ZeRO-3 cases belong to
fix-zero3-stale-grad-partitions, the others to fix-zero-offload-stale-grads.
"""

import pytest

from ds_harness.support.paths import Path, make_two_head_model
from ds_harness.support.reference_run import ZENFLOW

pytestmark = pytest.mark.pr("fix-zero-offload-stale-grads")

LR = 0.5
SET_GRAD = 0.25
SGD = {
    "optimizer": {
        "type": "SGD",
        "params": {
            "lr": LR,
            "weight_decay": None,  # merged into base_config's AdamW parameters: None removes the key
            "torch_adam": None
        }
    },
    "zero_force_ds_cpu_optimizer": False,
    "zero_allow_untested_optimizer": True,
}
CPU_OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
PATHS = {
    "zero1": Path(1, "fp32", SGD, model_fn=make_two_head_model),
    "zero1-offload": Path(1, "fp32", {**SGD, "zero_optimization": CPU_OFFLOAD}, model_fn=make_two_head_model),
    "zero2": Path(2, "fp32", SGD, model_fn=make_two_head_model),
    "zero2-offload": Path(2, "fp32", {**SGD, "zero_optimization": CPU_OFFLOAD}, model_fn=make_two_head_model),
    "zero3": Path(3, "fp32", {
        **SGD, "zero_optimization": {
            "stage3_param_persistence_threshold": 0
        }
    },
                  model_fn=make_two_head_model),
    "zero3-offload": Path(3, "fp32", {
        **SGD, "zero_optimization": {
            **CPU_OFFLOAD, "stage3_param_persistence_threshold": 0
        }
    },
                          model_fn=make_two_head_model),
}


def _assert_moved_by_the_set_gradient(path_name: str, params: dict, before: dict) -> None:
    """Each of ``params`` (head b's) moved by exactly lr * the gradient set (SGD-like at this learning rate)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    for name, p in params.items():
        after = safe_get_full_fp32_param(p)
        expected = before[name] - LR * SET_GRAD
        assert torch.equal(after, expected), (f"{path_name}: head_b.{name} moved by "
                                              f"{(after - before[name]).abs().max().item():g}, "
                                              f"not by lr * the gradient set ({LR * SET_GRAD:g})")


def _set_step_and_check(engine, path_name: str, head_b: dict, before: dict) -> None:
    """Set head b's gradients to SET_GRAD, step, and check that the value set drove the update."""
    import torch
    from deepspeed.utils import safe_set_full_grad
    from ds_harness.support.training import destroy

    for p in head_b.values():
        safe_set_full_grad(p, torch.full(p.ds_shape if hasattr(p, "ds_shape") else p.shape, SET_GRAD))
    engine.step()
    _assert_moved_by_the_set_gradient(path_name, head_b, before)
    destroy(engine)


def _set_gradient_drives_the_update(path_name: str) -> None:
    """Step 0 uses head a only: head b gets no gradient from backward, then its gradient is set before step()."""
    from deepspeed.utils import safe_get_full_fp32_param
    from ds_harness.support.training import forward_loss

    engine = PATHS[path_name].initialize(gas=1, managed=None)
    unused = dict(engine.module.head_b.named_parameters())
    before = {name: safe_get_full_fp32_param(p).clone() for name, p in unused.items()}
    engine.backward(forward_loss(engine, 0, 0))
    _set_step_and_check(engine, path_name, unused, before)


def _of_its_fix(path_name: str):
    """The ZeRO-3 cases belong to fix-zero3-stale-grad-partitions, whose set_fp32_grad_for_param() change (with
    offload: record the norm of the value set, so that step() does not overwrite it with the gradient partition)
    they check; the ZeRO-1/2 cases to fix-zero-offload-stale-grads, the file's PR."""
    if PATHS[path_name].stage == 3:
        return pytest.param(path_name, id=path_name, marks=pytest.mark.pr("fix-zero3-stale-grad-partitions"))
    return path_name


@pytest.mark.passes_on_pristine
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", [_of_its_fix(name) for name in sorted(PATHS)])
def test_gradient_set_on_a_parameter_without_one_drives_the_update(dist, path_name):
    dist.run(_set_gradient_drives_the_update, path_name)


def _set_gradient_after_a_step_with_one_drives_the_update(path_name: str) -> None:
    """Step 0 uses both heads, step 1 head a only, and head b's gradient is set before step 1's step(): the value
    set drives the update. With optimizer offload at ZeRO-1/2, step() clears the fp32 gradient slices an earlier
    step wrote and this one did not, and must count the value set as written in this step."""
    from deepspeed.utils import safe_get_full_fp32_param
    from ds_harness.support.training import forward_loss

    engine = PATHS[path_name].initialize(gas=1, managed=None)
    head_b = dict(engine.module.head_b.named_parameters())
    engine.module.use = "ab"
    engine.backward(forward_loss(engine, 0, 0))
    engine.step()
    before = {name: safe_get_full_fp32_param(p).clone() for name, p in head_b.items()}
    engine.module.use = "a"
    engine.backward(forward_loss(engine, 1, 0))
    _set_step_and_check(engine, path_name, head_b, before)


@pytest.mark.passes_on_pristine
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", [_of_its_fix(name) for name in sorted(PATHS)])
def test_gradient_set_after_a_step_with_one_drives_the_update(dist, path_name):
    dist.run(_set_gradient_after_a_step_with_one_drives_the_update, path_name)


def _set_gradient_replaces_the_backward_one(path_name: str) -> None:
    """Step 0 (two micro-batches) uses head a only: the trunk and head a get a gradient from both backward passes,
    then it is set before the boundary step(). The update must use the value set, not the gradient the backward
    accumulated: with optimizer
    offload, step() finishes only the gradients the boundary backward left pending (``_finalize_offloaded_gradients``
    in fix-zero-offload-stale-grads), and the boundary backward's own copy must leave none pending, or step()
    copies the host accumulation over the value set."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_grad
    from ds_harness.support.training import destroy, forward_loss

    # Two micro-batches: with one, the boundary backward copies straight into the fp32 partition and keeps
    # nothing in the host accumulation buffers
    engine = PATHS[path_name].initialize(gas=2, managed=None)
    engine.module.use = "a"
    used = {name: p for name, p in engine.module.named_parameters() if not name.startswith("head_b")}
    before = {name: safe_get_full_fp32_param(p).clone() for name, p in used.items()}
    engine.backward(forward_loss(engine, 0, 0))
    engine.step()  # not the boundary: accumulates
    engine.backward(forward_loss(engine, 0, 1))
    assert engine.is_gradient_accumulation_boundary()
    for p in used.values():
        safe_set_full_grad(p, torch.full(p.ds_shape if hasattr(p, "ds_shape") else p.shape, SET_GRAD))
    engine.step()
    for name, p in used.items():
        after = safe_get_full_fp32_param(p)
        expected = before[name] - LR * SET_GRAD
        moved = (after - before[name]).abs().max().item()
        assert torch.equal(after, expected), (f"{path_name}: {name} moved by {moved:g}, "
                                              f"not by lr * the gradient set ({LR * SET_GRAD:g})")
    destroy(engine)


@pytest.mark.passes_on_pristine
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["zero1-offload", "zero2-offload"])
def test_gradient_set_after_the_boundary_backward_replaces_its_gradient(dist, path_name):
    dist.run(_set_gradient_replaces_the_backward_one, path_name)


def _set_gradient_replaces_a_pending_one(path_name: str, managed: bool) -> None:
    """One meaning of safe_set_full_grad() before step(), at every stage and offload mode: the value set is the
    gradient step() applies. Here it is set on head b, whose gradient of the step is still pending when step() is
    called: managed, head b gets one only in the first of two micro-batches (the boundary backward does not reach it);
    unmanaged, every gradient is pending until step(). With optimizer offload at ZeRO-1/2, step() finishes pending
    gradients from the host accumulation buffers (``_finalize_offloaded_gradients``), and must not copy them over
    the value set, as ZeRO-3 and every configuration without offload keep it (and 0.19.3 in managed mode)."""
    from deepspeed.utils import safe_get_full_fp32_param
    from ds_harness.support.training import forward_loss

    engine = PATHS[path_name].initialize(gas=2 if managed else 1, managed=None if managed else False)
    head_b = dict(engine.module.head_b.named_parameters())
    before = {name: safe_get_full_fp32_param(p).clone() for name, p in head_b.items()}
    engine.module.use = "ab"
    engine.backward(forward_loss(engine, 0, 0))
    if managed:
        engine.step()  # not the boundary: accumulates
        engine.module.use = "a"
        engine.backward(forward_loss(engine, 0, 1))
        assert engine.is_gradient_accumulation_boundary()
    _set_step_and_check(engine, path_name, head_b, before)


@pytest.mark.passes_on_pristine
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", [_of_its_fix(name) for name in sorted(PATHS)])
def test_gradient_set_on_a_parameter_with_a_pending_one_drives_the_update(dist, path_name):
    dist.run(_set_gradient_replaces_a_pending_one, path_name, True)


def _unmanaged_of_its_fix(path_name: str):
    """Unmanaged mode: on 0.19.3 a promise of zero-offload (the last of its unmanaged PRs); on 0.19.8, whose flag is
    upstream's, of the fix PR that gives safe_set_full_grad() this meaning at the path's stage. Without offload, and
    at ZeRO-1 with offload, the value set is kept on 0.19.8 too (no regression test there); at ZeRO-2 and ZeRO-3
    with offload 0.19.8's unmanaged finalize copied the host accumulation over it."""
    fix = "fix-zero3-stale-grad-partitions" if PATHS[path_name].stage == 3 else "fix-zero-offload-stale-grads"
    marks = [pytest.mark.pr("zero-offload", fix)]
    if path_name not in ("zero2-offload", "zero3-offload"):
        marks.append(pytest.mark.passes_on_pristine)
    return pytest.param(path_name, id=path_name, marks=marks)


# Not ZeRO-2 without offload: there unmanaged mode reduces the gradients into the partition only in step(), and
# 0.19.8's safe_set_full_grad() before step() raises on the ranks holding a fragment ("Gradients are only available
# immediately after backward and before engine step"), untouched by the fix PRs.
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", [_unmanaged_of_its_fix(name) for name in sorted(PATHS) if name != "zero2"])
def test_unmanaged_gradient_set_before_step_drives_the_update(dist, path_name):
    dist.run(_set_gradient_replaces_a_pending_one, path_name, False)


#: ZenFlow ZeRO-2 with CPU offload (it always offloads) and a zero learning rate, so that weights, and with them
#: the gradients of the same micro-batches, stay equal across engines whatever ZenFlow's update schedule.
_ZENFLOW_LR0 = {
    "optimizer": {
        "type": "Adam",
        "params": {
            "lr": 0.0,
            "weight_decay": 0.0,
            "torch_adam": None
        }
    },
    "zero_allow_untested_optimizer": True,
}


def _zenflow(overlap_step: bool) -> Path:
    zero = {**ZENFLOW, "zenflow": {**ZENFLOW["zenflow"], "overlap_step": overlap_step}}
    return Path(2, "fp32", {**_ZENFLOW_LR0, "zero_optimization": zero}, model_fn=make_two_head_model)


def _zenflow_host_accumulation(overlap_step: bool) -> dict:
    """The host accumulation buffers of head b after two steps of two micro-batches: head b gets a gradient in the
    first micro-batch of step 0 only (so the boundary backward leaves it pending, which ZenFlow's overlapped step()
    does not finish), then in the last micro-batch of step 1 only. Its buffer must hold that gradient alone, not that
    gradient plus step 0's (pristine 0.19.3 adds by micro-batch index, so from step 1's second micro-batch on it
    adds whatever the buffer holds, for either ZenFlow optimizer alike)."""
    from ds_harness.support.training import destroy, forward_loss

    engine = _zenflow(overlap_step).initialize(gas=2, managed=None)
    for step, uses in enumerate((("ab", "a"), ("a", "ab"))):
        for i, use in enumerate(uses):
            engine.module.use = use
            engine.backward(forward_loss(engine, step, i))
            if step == 0 or i == 0:
                engine.step()
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()  # the copies into the host buffers are asynchronous
    optimizer = engine.optimizer
    buffers = {}
    for name, p in engine.module.head_b.named_parameters():
        param_id = optimizer.get_param_id(p)
        if param_id in optimizer.accumulated_grads_in_cpu:
            buffers[name] = optimizer.accumulated_grads_in_cpu[param_id].detach().cpu().clone()
    destroy(engine)
    return buffers


def _zenflow_overlapped_step_accumulates_no_stale_gradient() -> None:
    import torch

    sequential, overlapped = _zenflow_host_accumulation(False), _zenflow_host_accumulation(True)
    assert sequential.keys() == overlapped.keys()
    for name in sequential:
        assert torch.equal(overlapped[name], sequential[name]), (
            f"head_b.{name}: ZenFlow's overlapped step left step 0's host gradient to be added in step 1 (off by "
            f"{(overlapped[name] - sequential[name]).abs().max().item():g})")


@pytest.mark.passes_on_pristine
@pytest.mark.world_size(1, 2)
def test_zenflow_overlapped_step_adds_no_stale_host_gradient(dist):
    """ZenFlow runs only on CUDA GPUs: the multi-GPU workflow runs this (it runs the whole suite); skipped here."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("ZenFlow needs CUDA GPUs (the multi-GPU workflow runs this)")
    dist.run(_zenflow_overlapped_step_accumulates_no_stale_gradient)


def _read_gradient_of_a_parameter_without_one(path_name: str) -> None:
    """Step 0 uses both heads, step 1 head a only: before step 1's step(), safe_get_full_grad() of head b reads zero,
    not step 0's gradient, as ZeRO-1/2 without offload reads it. With optimizer offload the fix zeroes a stale fp32
    gradient slice only when something reads or steps on it (0.19.8 reads step 0's gradient)."""
    from deepspeed.utils import safe_get_full_grad
    from ds_harness.support.training import destroy, forward_loss

    engine = PATHS[path_name].initialize(gas=1, managed=None)
    engine.module.use = "ab"
    engine.backward(forward_loss(engine, 0, 0))
    engine.step()
    engine.module.use = "a"
    engine.backward(forward_loss(engine, 1, 0))
    for name, p in engine.module.head_b.named_parameters():
        grad = safe_get_full_grad(p)
        assert grad is not None and not grad.any(), (f"{path_name}: head_b.{name} read a gradient of "
                                                     f"{grad.abs().max().item():g} in a step that gave it none")
    engine.step()
    destroy(engine)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name", [
    pytest.param("zero1", marks=pytest.mark.passes_on_pristine), "zero1-offload",
    pytest.param("zero2", marks=pytest.mark.passes_on_pristine), "zero2-offload"
])
def test_gradient_read_of_a_parameter_without_one_is_zero(dist, path_name):
    dist.run(_read_gradient_of_a_parameter_without_one, path_name)
