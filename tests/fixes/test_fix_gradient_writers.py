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

pytestmark = [pytest.mark.pr("fix-zero-offload-stale-grads"), pytest.mark.passes_on_pristine]

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


def _set_gradient_drives_the_update(path_name: str) -> None:
    """Step 0 uses head a only: head b gets no gradient from backward, then its gradient is set before step()."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_grad
    from ds_harness.support.training import destroy, forward_loss

    engine = PATHS[path_name].initialize(gas=1, managed=None)
    unused = dict(engine.module.head_b.named_parameters())
    before = {name: safe_get_full_fp32_param(p).clone() for name, p in unused.items()}
    engine.backward(forward_loss(engine, 0, 0))
    for p in unused.values():
        safe_set_full_grad(p, torch.full(p.ds_shape if hasattr(p, "ds_shape") else p.shape, SET_GRAD))
    engine.step()
    for name, p in unused.items():
        after = safe_get_full_fp32_param(p)
        expected = before[name] - LR * SET_GRAD
        assert torch.equal(after, expected), (f"{path_name}: head_b.{name} moved by "
                                              f"{(after - before[name]).abs().max().item():g}, "
                                              f"not by lr * the gradient set ({LR * SET_GRAD:g})")
    destroy(engine)


def _of_its_fix(path_name: str):
    """The ZeRO-3 cases belong to fix-zero3-stale-grad-partitions, whose set_fp32_grad_for_param() change (with
    offload: record the norm of the value set, so that step() does not overwrite it with the gradient partition)
    they check; the ZeRO-1/2 cases to fix-zero-offload-stale-grads, the file's PR."""
    if PATHS[path_name].stage == 3:
        return pytest.param(path_name, id=path_name, marks=pytest.mark.pr("fix-zero3-stale-grad-partitions"))
    return path_name


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", [_of_its_fix(name) for name in sorted(PATHS)])
def test_gradient_set_on_a_parameter_without_one_drives_the_update(dist, path_name):
    dist.run(_set_gradient_drives_the_update, path_name)


def _set_gradient_replaces_the_backward_one(path_name: str) -> None:
    """Step 0 (two micro-batches) uses head a only: the trunk and head a get a gradient from both backward passes,
    then it is set before the boundary step(). The update must use the value set, not the gradient the backward accumulated: with optimizer
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
        assert torch.equal(after, expected), (f"{path_name}: {name} moved by {(after - before[name]).abs().max().item():g}, "
                                              f"not by lr * the gradient set ({LR * SET_GRAD:g})")
    destroy(engine)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["zero1-offload", "zero2-offload"])
def test_gradient_set_after_the_boundary_backward_replaces_its_gradient(dist, path_name):
    dist.run(_set_gradient_replaces_the_backward_one, path_name)
