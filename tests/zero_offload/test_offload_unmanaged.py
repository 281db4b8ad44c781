"""`zero-offload`: ZeRO-Offload in unmanaged mode: optimizer offload to CPU and NVMe (ZeRO stages 1, 2, 3), parameter
offload to CPU and NVMe (stage 3).

Every backward takes the offload path managed mode takes on a non-boundary micro-step (accumulate into the
host gradient buffers); step() does the boundary-time work (grad norm, overflow check, copy into the fp32
partition or swap-out to NVMe). Parity, discard, overflow, checkpoints, stale gradients of unused
parameters, the host/device traffic of one backward, and the offload options that are rejected.
"""

import pytest
import torch

from ds_harness.support import scenarios
from ds_harness.support.offload_paths import OFFLOAD_FP16_DYNAMIC, OFFLOAD_PATHS, ZERO3_OFFLOAD_BRANCHY
from ds_harness.support.paths import PATHS
from ds_harness.support.training import (
    assert_identical,
    assert_params_close,
    backward,
    destroy,
    forward_loss,
    run_managed,
    run_unmanaged,
    snapshot,
)

pytestmark = pytest.mark.pr("zero-offload")
PATH_NAMES = sorted(OFFLOAD_PATHS)
SMALL = ["zero1-offload", "zero2-offload", "zero3-offload", "zero3-offload-param"]


def _scenario(name, *args):
    # Runs on the ranks from this module, whose import registers OFFLOAD_PATHS in ds_harness.support.paths.PATHS.
    return getattr(scenarios, name)(*args)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("path_name", PATH_NAMES)
def test_n_backwards_then_step_equals_managed_gas_n(dist, path_name, n):
    dist.run(_scenario, "fixed_n_parity", path_name, n)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("path_name", SMALL)
def test_n_backwards_then_step_equals_managed_gas_n_on_4_ranks(dist, path_name):
    dist.run(_scenario, "fixed_n_parity", path_name, 3)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", PATH_NAMES)
def test_variable_n_equals_boundary_driven_managed_engine(dist, path_name):
    dist.run(_scenario, "variable_n_parity", path_name, [1, 3, 2, 5])


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("path_name", SMALL)
def test_variable_n_matches_a_full_batch_pytorch_reference(dist, path_name):
    dist.run(_scenario, "full_batch_reference", path_name, [1, 3, 2, 5])


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", PATH_NAMES)
def test_zero_grad_discards_a_partial_accumulation(dist, path_name):
    dist.run(_scenario, "zero_grad_discards", path_name)


# ZeRO-3 with optimizer offload records the gradient set with safe_set_full_grad() as final (step() must not
# overwrite it with the gradient partition): zero_grad() must forget that too
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["zero3-offload"])
def test_zero_grad_discards_gradients_no_later_backward_overwrites(dist, path_name):
    dist.run(_scenario, "zero_grad_discards_what_no_later_backward_overwrites", path_name)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", OFFLOAD_FP16_DYNAMIC)
def test_fp16_overflow_skips_the_step_and_clears_the_accumulation(dist, path_name):
    dist.run(_scenario, "fp16_overflow_inside_accumulation", path_name)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", [
    "zero1-offload", "zero2-offload", "zero2-offload-bf16", "zero2-offload-nvme", "zero3-offload",
    "zero3-offload-param", "zero3-offload-param-nvme"
])
def test_checkpoint_round_trip_reproduces_an_uninterrupted_run(dist, path_name, tmp_path):
    dist.run(_scenario, "checkpoint_round_trip", path_name, str(tmp_path))


def _resume_equals_managed_resume(path_name: str, save_dir: str) -> None:
    """DeepSpeedCPUAdam does not resume bitwise even in managed mode (its bias corrections after
    load_checkpoint() differ from an uninterrupted run's in the last bits), so an unmanaged save/resume
    is compared bitwise with the same save/resume in managed mode."""
    path = PATHS[path_name]
    results = []
    for managed in (True, False):
        run = run_managed if managed else run_unmanaged
        first = path.initialize(gas=2, managed=managed)
        run(first, [2, 2])
        first.save_checkpoint(f"{save_dir}/{managed}", tag="resume")
        destroy(first)
        resumed = path.initialize(gas=2, managed=managed)
        resumed.load_checkpoint(f"{save_dir}/{managed}", tag="resume")
        run(resumed, [2, 2], first_step=2)
        results.append(snapshot(resumed))
        destroy(resumed)
    assert_identical(*results, f"{path_name}: resumed unmanaged vs resumed managed")


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["zero2-offload-cpu-adam", "zero3-offload-nvme"])
def test_checkpoint_round_trip_with_cpu_adam_equals_managed(dist, path_name, tmp_path):
    dist.run(_resume_equals_managed_resume, path_name, str(tmp_path))


@pytest.mark.world_size(1, 2)
def test_boundary_and_bookkeeping(dist):
    dist.run(_scenario, "boundary_only_during_step", "zero2-offload")
    dist.run(_scenario, "bookkeeping", "zero2-offload", False)
    dist.run(_scenario, "bookkeeping", "zero2-offload", True)


def _unused_parameters_get_no_stale_gradient(path_name: str, n: int, reference: str = None) -> None:
    """The branch layer gets a gradient only in some micro-batches, in some steps in none at all, and in
    some steps not in the last one. Its gradient must be the sum over this step's micro-batches only:
    not the CPU accumulation buffer's value from an earlier step (accumulated into the first backward
    that uses it), and not the fp32 partition's value from the last step that copied into it.

    Reference: the same engine without offload, whose gradient partitions are rebuilt each step. The
    offload path computes the global norm from per-parameter fp64 norms, the non-offload path from the
    fp32 flat partition, so the norm (and hence the clip coefficient) may differ in the last bits: the
    comparison allows 1e-6 relative; a stale gradient is off by orders of magnitude more (~1e-2).
    """
    if reference is None:
        plain = PATHS[path_name].initialize(gas=n, managed=False, zero_optimization={"offload_optimizer": None})
    else:
        plain = PATHS[reference].initialize(gas=n, managed=False)
    run_unmanaged(plain, [n] * 4)
    expected = snapshot(plain)
    destroy(plain)
    for managed in (True, False):
        path = PATHS[path_name] if path_name in PATHS else ZERO3_OFFLOAD_BRANCHY
        engine = path.initialize(gas=n, managed=managed)
        (run_managed if managed else run_unmanaged)(engine, [n] * 4)
        actual = snapshot(engine)
        destroy(engine)
        for name, p in expected.params.items():
            torch.testing.assert_close(actual.params[name],
                                       p,
                                       rtol=1e-6,
                                       atol=1e-8,
                                       msg=lambda m: f"{path_name} managed={managed} {name}: {m}")
        assert actual.scalars["grad_norm"] == pytest.approx(expected.scalars["grad_norm"], rel=1e-6)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_unused_parameters_get_no_stale_gradient(dist, stage, n):
    dist.run(_unused_parameters_get_no_stale_gradient, f"zero{stage}-offload-branchy", n)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("n", [1, 3])
def test_unused_parameters_get_no_stale_gradient_zero3(dist, n):
    # Against ZeRO-2 without offload (bitwise equal to ZeRO-3 on a model without unused parameters); 0.19.3's
    # stale ZeRO-3 partitions are fixed by fix-zero3-stale-grad-partitions, earlier in the series.
    dist.run(_unused_parameters_get_no_stale_gradient, "zero3-offload-branchy", n, "zero2-branchy")


class _CopyTraffic(torch.overrides.TorchFunctionMode):
    """Bytes moved by Tensor.copy_ between the offload host buffers and everything else.

    Host buffers are the optimizer's CPU-side tensors: the CPU gradient accumulation buffers, the fp32
    master partitions and their gradients, and the bit16 staging buffers. Any other tensor (param.grad,
    the reduction buckets, the temporary gradient buffer) lives on the accelerator. On a GPU these are
    the PCIe transfers; on the CPU accelerator the classification by buffer is the same, so the counts
    are the transfers the code would issue.
    """

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer = optimizer
        self.phase = None
        self.traffic = {}

    def _host(self):
        opt = self.optimizer
        tensors = list(opt.accumulated_grads_in_cpu.values()) + list(opt.param_buffer_of_bit16_for_cpu_offload_groups)
        for fp32 in opt.single_partition_of_fp32_groups:
            tensors += [fp32, fp32.grad]
        return {t.untyped_storage().data_ptr() for t in tensors if t is not None}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and self.phase is not None:
            dst, src = args[0], args[1]
            host = self._host()
            to_host, from_host = dst.untyped_storage().data_ptr() in host, src.untyped_storage().data_ptr() in host
            if to_host != from_host:
                h2d, d2h = self.traffic.setdefault(self.phase, [0, 0])
                nbytes = dst.numel() * dst.element_size()
                self.traffic[self.phase] = [h2d + (0 if to_host else nbytes), d2h + (nbytes if to_host else 0)]
        return func(*args, **(kwargs or {}))


def _copy_traffic(path_name: str, n: int, managed: bool) -> dict:
    engine = PATHS[path_name].initialize(gas=n, managed=managed)
    mode = _CopyTraffic(engine.optimizer)
    with mode:
        for step in range(2):
            for i in range(n):
                loss = forward_loss(engine, step, i)
                mode.phase = ("backward", step, i)
                backward(engine, loss)
                mode.phase = ("step", step, i) if managed else None
                if managed:
                    engine.step()
            mode.phase = ("step", step)
            if not managed:
                engine.step()
            mode.phase = None
    destroy(engine)
    return {k: tuple(v) for k, v in mode.traffic.items()}


def _per_backward_traffic_matches_managed_non_boundary_path(path_name: str) -> None:
    """Host/device bytes of every unmanaged backward equal those of a managed non-boundary micro-step.

    Managed mode with gradient_accumulation_steps=3 moves, per parameter gradient in the rank's
    partition: micro-step 0 one device-to-host copy into the CPU accumulation buffer; micro-step 1 one
    host-to-device copy of that buffer (added on the device) and one device-to-host copy back; the
    boundary micro-step 2 the same plus the copy into the fp32 partition. Unmanaged backward i must move
    exactly what managed micro-step i moves for i = 0, 1, and its third backward exactly what a managed
    non-boundary micro-step moves (the second): no backward pays for boundary work. step() then moves
    the accumulated gradients once to the device and once into the fp32 partition (the norm is computed
    on the device, as on the managed boundary, so the result is bitwise the same on a real GPU).
    """
    n = 3
    managed = _copy_traffic(path_name, n, managed=True)
    unmanaged = _copy_traffic(path_name, n, managed=False)
    for step in range(2):
        first, middle, boundary = (managed.get(("backward", step, i), (0, 0)) for i in range(n))
        assert first[0] == 0 and first[1] > 0, f"managed first micro-step: {first}"
        assert middle[0] == first[1] and middle[1] == first[1], f"managed non-boundary micro-step: {middle}"
        assert boundary[0] == middle[0] and boundary[1] > middle[1], f"managed boundary micro-step: {boundary}"
        per_backward = [unmanaged.get(("backward", step, i), (0, 0)) for i in range(n)]
        assert per_backward == [first, middle, middle], f"unmanaged {per_backward} vs managed {first}, {middle}"
        grads = first[1]  # bytes of this rank's offloaded gradients
        to_fp32 = boundary[1] - middle[1]
        managed_step = managed.get(("step", step, n - 1), (0, 0))
        assert unmanaged[("step", step)] == (managed_step[0] + grads, managed_step[1] + to_fp32), \
            f"unmanaged step() {unmanaged[('step', step)]} vs managed step {managed_step}"


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["zero2-offload", "zero2-offload-bf16"])
def test_per_backward_host_device_traffic_matches_managed_non_boundary_path(dist, path_name):
    dist.run(_per_backward_traffic_matches_managed_non_boundary_path, path_name)


def _boundary_work_per_phase(path_name: str, n: int, managed: bool) -> dict:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    engine = PATHS[path_name].initialize(gas=n, managed=managed)
    counts, phase = {}, [None]
    if isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3):
        cls, name = DeepSpeedZeroOptimizer_Stage3, "_copy_grad_partition_to_fp32_partition"
    else:
        cls, name = DeepSpeedZeroOptimizer, "_copy_accumulated_grad_to_fp32_partition"
    original = getattr(cls, name)

    def counting(self, *args, **kwargs):
        counts[phase[0]] = counts.get(phase[0], 0) + 1
        return original(self, *args, **kwargs)

    setattr(cls, name, counting)
    try:
        for i in range(n):
            loss = forward_loss(engine, 0, i)
            phase[0] = ("backward", i)
            backward(engine, loss)
            phase[0] = "step"
            if managed or i == n - 1:
                engine.step()
    finally:
        setattr(cls, name, original)
        destroy(engine)
    return counts


def _no_boundary_work_in_any_backward(path_name: str) -> None:
    """The boundary-time work (per-parameter norm, overflow check, copy into the fp32 partition or the
    NVMe swap-out) runs in no unmanaged backward, and once per offloaded gradient in step(): exactly as
    often as managed mode runs it on its boundary micro-step."""
    managed = _boundary_work_per_phase(path_name, 3, True)
    unmanaged = _boundary_work_per_phase(path_name, 3, False)
    boundary = managed.get(("backward", 2), 0) + managed.get("step", 0)
    assert boundary > 0 and not any(managed.get(("backward", i)) for i in range(2)), managed
    assert set(unmanaged) == {"step"} and unmanaged["step"] == boundary, f"unmanaged {unmanaged}, managed {managed}"


@pytest.mark.base("0.19.3", reason="checks the 0.19.3 series' internals (its private methods and hooks)")
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["zero1-offload", "zero2-offload", "zero3-offload", "zero3-offload-nvme"])
def test_boundary_work_runs_only_in_step(dist, path_name):
    dist.run(_no_boundary_work_in_any_backward, path_name)


def _config_error(zero: dict, expected: str) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    from ds_harness.support.training import base_config

    config = base_config(1, managed=False, stage=zero.pop("stage"), zero_optimization=zero)
    with pytest.raises(DeepSpeedConfigError, match="managed_gradient_accumulation=false") as error:
        DeepSpeedConfig(config)
    assert expected in str(error.value), str(error.value)
    config["managed_gradient_accumulation"] = True
    DeepSpeedConfig(config)  # managed mode accepts it


SUPER_OFFLOAD = {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}
ZENFLOW = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.1}}
REJECTED = {
    "super-offload": (SUPER_OFFLOAD, "zero_optimization.offload_optimizer.super_offload"),
    "zenflow": (ZENFLOW, "zero_optimization.zenflow"),
}


@pytest.mark.base("0.19.3", reason="the 0.19.3 series refuses them; 0.19.8 accepts them with the flag off, and its "
                  "follow-ups keep that")
@pytest.mark.world_size(1)
@pytest.mark.parametrize("option", sorted(REJECTED))
def test_rejected_offload_engines(dist, option):
    dist.run(_config_error, *REJECTED[option])


def _unmanaged_unused_parameters_match_pytorch(stage: int, offload: bool) -> None:
    """Issue "review round 1", item 1: a parameter unused in whole steps (and in some micro-batches), gradient
    clipping, a variable N: unmanaged mode equals plain PyTorch (clip over the real gradients, a zero
    gradient for a parameter without one), with and without optimizer offload."""
    import deepspeed.comm as ds_comm

    from ds_harness.support import pytorch_reference
    from ds_harness.support.paths import CLIP, Path, make_branchy_model

    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    plan = [1, 2, 3, 1, 2]  # the branch: unused in steps 2 and 4, first micro-batch only in step 1, ...
    engine = Path(stage, "fp32", {
        **CLIP, "zero_optimization": zero
    }, model_fn=make_branchy_model).initialize(gas=1, managed=False)
    run_unmanaged(engine, plan, divide_by_n=True)
    actual = snapshot(engine).params
    destroy(engine)
    expected = pytorch_reference.run(make_branchy_model, plan, ds_comm.get_world_size(), CLIP["gradient_clipping"])
    assert_params_close(actual, expected, f"ZeRO-{stage}, plan {plan}", rtol=1e-5, atol=1e-6)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage, offload", [(2, True), (3, False), (3, True)],
                         ids=["zero2-offload", "zero3", "zero3-offload"])
def test_unused_parameters_with_clipping_match_pytorch(dist, stage, offload):
    dist.run(_unmanaged_unused_parameters_match_pytorch, stage, offload)
