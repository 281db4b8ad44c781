"""Every writer of a gradient partition steps on this step's gradients with the stale-gradient fixes.

``fix-zero3-stale-grad-partitions`` and ``fix-zero-offload-stale-grads`` clear the gradients once ``step()`` has
used them (and finish in ``step()`` those still pending), instead of zeroing at the next ``step()`` what the base
backward path did not record. So a gradient written some other way before ``step()`` is what the optimizer steps
on. Here each writer of 0.19.8 besides the base reduce path (which the other files of tests/fixes check):

- ``safe_set_full_grad()`` / ``safe_get_full_grad()``, at every stage, with and without optimizer offload: set on a
  parameter that got no gradient in the step (its head was not used), the value must drive the update, as in
  DeepSpeed 0.19.3 (an earlier version of the fixes zeroed it); set after the boundary backward on parameters that
  got a gradient in it, or on one with a pending gradient, it must replace that gradient; read for a parameter
  without a gradient in the step, it is zero. Plain SGD with lr 0.5 and a set gradient of 0.25: the expected
  parameter is exact.
- Muon with CPU optimizer offload at ZeRO-1/2 and Muon at ZeRO-3 (CPU), against Muon at ZeRO-1/2 without offload.
- The compact gradient buffer (bf16 with fp32 gradient accumulation) with CPU offload, both modes (CPU), against the
  same engine without offload.
- GPU-only, skipped on the CPU accelerator and run by the multi-GPU workflow (it runs the whole suite): ZenFlow
  with its sequential step at ZeRO-2 and ZeRO-3 and, unmanaged, both ZenFlow steps at ZeRO-2 (gradient norms
  against PyTorch at lr 0), ZenFlow's overlapped step at ZeRO-2 (against its sequential one) and at ZeRO-3 (only
  where 0.19.8 was right), DeepCompile without offload at ZeRO-1 and ZeRO-3 against PyTorch. (DeepCompile ZeRO-3
  with offload and SuperOffload: test_fix_zero3_stale_grad_partitions.py.)

The ZeRO-3 cases belong to fix-zero3-stale-grad-partitions, the others to fix-zero-offload-stale-grads.
"""

import pytest

from ds_harness.support.paths import Path, make_two_head_model, plain_sgd
from ds_harness.support.reference_run import ZENFLOW

pytestmark = pytest.mark.pr("fix-zero-offload-stale-grads")

LR = 0.5
SET_GRAD = 0.25
SGD = plain_sgd(LR)
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


def _skip_without_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"{what} needs CUDA GPUs (the multi-GPU workflow runs this)")


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


def _zenflow(overlap_step: bool, stage: int = 2, model_fn=make_two_head_model) -> Path:
    zero = {**ZENFLOW, "zenflow": {**ZENFLOW["zenflow"], "overlap_step": overlap_step}}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return Path(stage, "fp32", {**_ZENFLOW_LR0, "zero_optimization": zero}, model_fn=model_fn)


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
    _skip_without_cuda("ZenFlow")
    dist.run(_zenflow_overlapped_step_accumulates_no_stale_gradient)


def _read_gradient_of_a_parameter_without_one(path_name: str) -> None:
    """Step 0 uses both heads, step 1 head a only: before step 1's step(), safe_get_full_grad() of head b reads zero,
    not step 0's gradient, as ZeRO-1/2 without offload reads it. With optimizer offload the fix zeroes a stale fp32
    gradient slice only when something reads or steps on it (0.19.8 reads step 0's gradient). ZeRO-3 reads the
    gradient partition, which the fix zeroes once a step has left it stale (0.19.8 reads step 0's); with offload,
    before step() has finished the fp32 partition, the gradient partition that step() will copy (0.19.8 reads the fp32
    partition, which holds step 0's)."""
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
    pytest.param("zero2", marks=pytest.mark.passes_on_pristine), "zero2-offload",
    _of_its_fix("zero3"),
    _of_its_fix("zero3-offload"),
])
def test_gradient_read_of_a_parameter_without_one_is_zero(dist, path_name):
    dist.run(_read_gradient_of_a_parameter_without_one, path_name)


#: Muon (MuonWithAuxAdam): the 2-D weights take Muon's orthogonalized update, the biases torch's AdamW (the
#: auxiliary optimizer, torch_adam, with and without offload alike). No clipping, so nothing but the gradients
#: can differ between the engines compared.
_MUON = {
    "optimizer": {
        "type": "Muon",
        "params": {
            "lr": 1e-2,
            "momentum": 0.9,
            "weight_decay": 0.0,
            "torch_adam": True
        }
    },
    "zero_force_ds_cpu_optimizer": False,
    "gradient_clipping": 0.0,
}


def _muon_trained(stage: int, offload: bool, n: int) -> dict:
    """Parameters after 4 managed steps of GAS ``n`` of Muon on the branch model (the branch unused in some
    micro-batches, in some steps in all)."""
    from ds_harness.support.paths import make_branchy_model
    from ds_harness.support.training import destroy, run_managed, snapshot

    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    if stage == 3:
        # ZeRO-3 runs Muon only without reduce-scatter
        zero = {**zero, "reduce_scatter": False, "stage3_param_persistence_threshold": 0}
    engine = Path(stage, "fp32", {**_MUON, "zero_optimization": zero},
                  model_fn=make_branchy_model).initialize(gas=n, managed=None)
    run_managed(engine, [n] * 4)
    params = snapshot(engine).params
    destroy(engine)
    return params


def _muon_matches(stage: int, offload: bool, n: int) -> None:
    """Muon on a ZeRO path steps like Muon at ZeRO-1/2 without offload (ZeRO-1 for the ZeRO-3 paths), whose
    gradients take the base reduce path, on the same model and batches. With CPU optimizer offload at ZeRO-1/2 Muon
    orthogonalizes in step() the fp32 gradient partitions the offloaded reduce path wrote
    (``_apply_muon_updates_cpu_offload``), once step() has finished the gradients still pending and zeroed the stale
    slices; without offload, the reduced gradients at the boundary; at ZeRO-3, the accumulated gradient partitions
    in step(). Partitions and reduction order differ in the last bits; a stale or lost gradient of the branch turns
    its whole update (Muon normalizes it), far above the tolerance, and through the branch the trunk's later ones."""
    from ds_harness.support.training import assert_params_close

    reference_stage = 1 if stage == 3 else stage
    assert_params_close(_muon_trained(stage, offload, n), _muon_trained(reference_stage, False, n),
                        f"Muon, ZeRO-{stage}{' + CPU offload' if offload else ''}, GAS={n}", rtol=1e-5, atol=1e-6)


@pytest.mark.base("0.19.8", reason="0.19.3 runs Muon only in the ZeRO-1/2 reduce path without optimizer offload")
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("n", [1, 2], ids=["gas1", "gas2"])
@pytest.mark.parametrize("stage", [1, 2], ids=["zero1", "zero2"])
def test_muon_with_optimizer_offload_matches_no_offload(dist, stage, n):
    dist.run(_muon_matches, stage, True, n)


@pytest.mark.pr("fix-zero3-stale-grad-partitions")
@pytest.mark.base("0.19.8", reason="0.19.3 runs Muon only in the ZeRO-1/2 reduce path without optimizer offload")
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("n", [1, 2], ids=["gas1", "gas2"])
@pytest.mark.parametrize("offload", [False, True], ids=["zero3", "zero3-offload"])
def test_muon_at_zero3_matches_zero1(dist, offload, n):
    dist.run(_muon_matches, 3, offload, n)


def _compact_buffer_offload_matches_no_offload(stage: int, n: int, managed: bool) -> None:
    """bf16 with fp32 gradient accumulation keeps a rank's reduced gradients in one compact fp32 buffer; with CPU
    optimizer offload the boundary copies them from there into the offloaded fp32 partitions (and step() those still
    pending, ``_finalize_cpu_offload_gradient_accumulation``). The same engine without offload steps on the reduced
    gradients directly. On the branch model both must step alike: the fp32 master weights agree up to the offload
    norm (per-parameter fp64 norms, for the clipping) in the last bits; a stale or lost gradient of the branch is off
    by ~1e-3."""
    from ds_harness.support.paths import CLIP, make_branchy_model
    from ds_harness.support.training import assert_params_close, destroy, run_managed, run_unmanaged, snapshot

    results = []
    for offload in (True, False):
        zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
        path = Path(stage, "bf16", {
            **CLIP, "data_types": {
                "grad_accum_dtype": "fp32"
            },
            "zero_optimization": zero
        },
                    model_fn=make_branchy_model)
        engine = path.initialize(gas=n if managed else 1, managed=None if managed else False)
        if offload:
            assert all(engine.optimizer._use_compact_grad_partition_buffer(i)
                       for i in range(len(engine.optimizer.bit16_groups))), "the compact gradient buffer is not used"
        (run_managed if managed else run_unmanaged)(engine, [n] * 4)
        results.append(snapshot(engine).params)
        destroy(engine)
    offloaded, plain = results
    mode = f"GAS={n}" if managed else f"unmanaged, {n} backward passes per step"
    assert_params_close(offloaded, plain, f"bf16 + fp32 accumulation, ZeRO-{stage} + CPU offload, {mode}", rtol=1e-5,
                        atol=1e-6)


# GAS 1: the branch unused in whole steps after a step that used it (a stale fp32 slice); GAS 2: used only in the
# first micro-batch of a step (pending at step()), only in the last, in none
@pytest.mark.base("0.19.8", reason="0.19.3 has no compact gradient partition buffer")
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
@pytest.mark.parametrize("n", [1, 2], ids=["gas1", "gas2"])
@pytest.mark.parametrize("stage", [1, 2], ids=["zero1", "zero2"])
def test_compact_gradient_buffer_with_offload_matches_no_offload(dist, stage, n, managed):
    dist.run(_compact_buffer_offload_matches_no_offload, stage, n, managed)


def _grad_norms(path: Path, n: int, managed: bool = True) -> list:
    """The global gradient norm of each of 4 steps of ``n`` micro-batches (managed: GAS ``n``; unmanaged: ``n``
    backward passes, then step()). At lr 0 the weights stay the initial ones, whatever ZenFlow's update schedule;
    the norm is taken over the gradient partitions the step consumes (with offload, the per-partition norms the
    boundary and step() record), so a stale partition or one the step lost changes it."""
    from ds_harness.support.training import destroy, forward_loss

    engine = path.initialize(gas=n if managed else 1, managed=None if managed else False)
    norms = []
    for step in range(4):
        for i in range(n):
            engine.backward(forward_loss(engine, step, i))
            if managed:
                engine.step()
        if not managed:
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    destroy(engine)
    return norms


def _pytorch_grad_norms(model_fn, n: int, managed: bool = True) -> list:
    """Plain PyTorch at the initial weights: the norm of each step's gradient over the global batch (the mean loss
    of every micro-batch of every rank; unmanaged, the sum over the backward passes of their mean over the ranks),
    a parameter without a gradient counting zero."""
    import deepspeed.comm as ds_comm
    import torch

    from ds_harness.support import training

    model = model_fn()
    world_size = ds_comm.get_world_size()
    norms = []
    for step in range(4):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for rank in range(world_size):
            for index in range(n):
                training._CURRENT = (step, index)  # the branch model's control flow reads it
                x, y = training.micro_batch(step, index, rank=rank)
                (training.loss_fn(model(x), y) / ((n if managed else 1) * world_size)).backward()
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
    return norms


def _zenflow_norms_match_pytorch(stage: int, overlap_step: bool, n: int, model_fn, managed: bool = True) -> None:
    actual = _grad_norms(_zenflow(overlap_step, stage, model_fn), n, managed)
    expected = _pytorch_grad_norms(model_fn, n, managed)
    # Transposed partitions (ZenFlow), per-partition fp64 norms and another reduction order: the last bits; a stale
    # or lost partition of the branch moves the norm by far more
    assert actual == pytest.approx(expected, rel=1e-5), (
        f"ZenFlow ZeRO-{stage} ({'overlapped' if overlap_step else 'sequential'} step), "
        f"{f'GAS={n}' if managed else f'unmanaged, {n} backward passes'}: gradient norms per step {actual}, "
        f"PyTorch's {expected}")


# At ZeRO-2 with GAS 1 the norm cannot tell: a parameter without a gradient in the step is left out of it, stale
# fp32 slice or not (the update is what differs there)
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("stage, n", [
    pytest.param(2, 2, id="zero2-gas2"),
    pytest.param(3, 1, id="zero3-gas1", marks=pytest.mark.pr("fix-zero3-stale-grad-partitions")),
    pytest.param(3, 2, id="zero3-gas2", marks=pytest.mark.pr("fix-zero3-stale-grad-partitions")),
])
def test_zenflow_sequential_step_steps_on_this_steps_gradients(dist, stage, n):
    """ZenFlow with its sequential step (``overlap_step`` false) runs the base ZeRO ``step()`` and, at ZeRO-3, the
    base ``partition_grads()``: on the branch model (the branch unused in some micro-batches, in some steps in all)
    its gradient norm per step is PyTorch's. ZenFlow runs only on CUDA GPUs (its ZeRO-3 allocates on 'cuda'
    outright): the multi-GPU workflow runs this; skipped on CPU."""
    from ds_harness.support.paths import make_branchy_model

    _skip_without_cuda("ZenFlow")
    dist.run(_zenflow_norms_match_pytorch, stage, False, n, make_branchy_model)


@pytest.mark.pr("fix-zero3-stale-grad-partitions")
@pytest.mark.passes_on_pristine
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("n", [1, 2], ids=["gas1", "gas2"])
def test_zenflow_zero3_overlapped_step_unchanged_where_every_parameter_gets_a_gradient(dist, n):
    """ZenFlow ZeRO-3 with ``overlap_step`` replaces ``partition_grads()`` and ``step()`` and keeps its fp32 gradients
    in ``overlap_grad``; fix-zero3-stale-grad-partitions leaves it as 0.19.8 has it (its completion in
    ``_pre_step()`` skips sub-groups without an fp32 ``.grad``; the clearing runs only where its step reaches
    ``_post_step()``). Not fixed there, as in 0.19.8: a parameter without a gradient in some micro-batches (a stale
    add, a partition the boundary backward misses), so this checks only what 0.19.8 got right: with every parameter
    used in every micro-batch, its gradient norm per step is PyTorch's. ZenFlow runs only on CUDA GPUs: the
    multi-GPU workflow runs this; skipped on CPU."""
    from ds_harness.support.paths import make_model

    _skip_without_cuda("ZenFlow")
    dist.run(_zenflow_norms_match_pytorch, 3, True, n, make_model)


def _deepcompile_matches_pytorch(stage: int, n: int) -> None:
    """DeepCompile without optimizer offload, 4 managed steps of GAS ``n`` on the branch model, against plain
    PyTorch over the same global batches (AdamW, clipping, a zero gradient for a parameter without one). At ZeRO-3
    its compiled reductions write the gradient partitions (copy or add, decided in the compiled graph) that step()
    consumes and fix-zero3-stale-grad-partitions clears after it; at ZeRO-1 the engine's reduce path runs."""
    import deepspeed.comm as ds_comm

    from ds_harness.support import pytorch_reference
    from ds_harness.support.paths import CLIP, make_branchy_model
    from ds_harness.support.training import assert_params_close, destroy, run_managed, snapshot

    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    path = Path(stage, "fp32", {
        **CLIP, "compile": {
            "deepcompile": True
        },
        "zero_optimization": zero
    },
                model_fn=make_branchy_model,
                zero_init=stage == 3)
    engine = path.initialize(gas=n, managed=None)
    engine.compile()
    run_managed(engine, [n] * 4)
    actual = snapshot(engine).params
    destroy(engine)
    expected = pytorch_reference.run(make_branchy_model, [n] * 4, ds_comm.get_world_size(), CLIP["gradient_clipping"])
    # Compiled kernels may round differently from eager ones; a stale or lost gradient is off by ~1e-3
    assert_params_close(actual, expected, f"DeepCompile ZeRO-{stage}, GAS={n}", rtol=1e-4, atol=1e-5)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("n", [1, 2], ids=["gas1", "gas2"])
@pytest.mark.parametrize("stage", [
    pytest.param(1, id="zero1", marks=pytest.mark.passes_on_pristine),
    pytest.param(3, id="zero3", marks=pytest.mark.pr("fix-zero3-stale-grad-partitions")),
])
def test_deepcompile_without_offload_matches_pytorch(dist, stage, n):
    """DeepCompile needs CUDA GPUs: the multi-GPU workflow runs this; skipped on CPU. (With optimizer offload at
    ZeRO-3: test_fix_zero3_stale_grad_partitions.py.) At ZeRO-1 no line of the fix PRs runs: a check that they leave
    it as it was."""
    _skip_without_cuda("DeepCompile")
    dist.run(_deepcompile_matches_pytorch, stage, n)


@pytest.mark.base("0.19.8", reason="the 0.19.3 series refuses ZenFlow with managed_gradient_accumulation=false")
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("overlap_step", [False, True], ids=["sequential", "overlapped"])
def test_zenflow_unmanaged_step_steps_on_this_steps_gradients(dist, overlap_step):
    """0.19.8 accepts ZenFlow with managed_gradient_accumulation=false. At ZeRO-2 the engine's unmanaged finalize
    (``finalize_gradient_accumulation_boundary()``, before either ZenFlow step()) copies every pending gradient into
    the fp32 partitions, through ZenFlow's copy override with its overlapped step: on the branch model, two backward
    passes per step, the gradient norm per step is PyTorch's at lr 0, for both ZenFlow steps. ZenFlow runs only on
    CUDA GPUs: the multi-GPU workflow runs this; skipped on CPU."""
    from ds_harness.support.paths import make_branchy_model

    _skip_without_cuda("ZenFlow")
    dist.run(_zenflow_norms_match_pytorch, 2, overlap_step, 2, make_branchy_model, False)
