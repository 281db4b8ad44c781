"""`zero-0-1`, `zero-2`, `zero-3`: what unmanaged mode promises besides parity - boundary, bookkeeping, discard, fp16
overflow, checkpoints, memory, 16-bit export - on every ZeRO stage."""

import pytest

from ds_harness.support import scenarios
from ds_harness.support.cases import cases
from ds_harness.support.memory_assertions import assert_same_gradient_memory
from ds_harness.support.paths import FP16_DYNAMIC, ZERO_0_1_PATHS, ZERO_2_PATHS, ZERO_3_PATHS

ALL = sorted(ZERO_0_1_PATHS) + sorted(ZERO_2_PATHS) + sorted(ZERO_3_PATHS)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", cases("fp32-deepspeed-optimizer", "zero1-fp32", "zero1-bf16-fp32-accumulation",
                                            "zero2-fp32", "zero3-fp32"))
def test_boundary_is_true_only_while_step_runs(dist, path_name):
    dist.run(scenarios.boundary_only_during_step, path_name)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("torch_style", [False, True])
@pytest.mark.parametrize("path_name", cases("fp32-deepspeed-optimizer", "bf16", "zero1-fp32", "zero2-fp32",
                                            "zero3-fp32"))
def test_bookkeeping_counts_steps_and_backward_passes(dist, path_name, torch_style):
    if torch_style and path_name in ("fp32-deepspeed-optimizer", "bf16"):
        pytest.skip("DeepSpeed supports engine.scale(loss).backward() only with a ZeRO optimizer")
    dist.run(scenarios.bookkeeping, path_name, torch_style)


@pytest.mark.base("0.19.3", reason="bitwise equality of the two backward styles is the 0.19.3 series' promise; "
                   "0.19.8's engine.backward() scales the loss on another path (last-bit differences), and both "
                   "count as backward passes there (test_bookkeeping_counts_steps_and_backward_passes)")
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", cases("zero1-fp32", "zero2-fp32", "zero3-fp32"))
def test_torch_style_backward_accumulates_like_engine_backward(dist, path_name):
    dist.run(scenarios.torch_style_backward_parity, path_name)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", cases(*ALL))
def test_zero_grad_discards_a_partial_accumulation(dist, path_name):
    dist.run(scenarios.zero_grad_discards, path_name)


# The parameters the kept backward passes do not reach: ZeRO-3 keeps their gradient partitions outside .grad
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", cases("zero3-fp32"))
def test_zero_grad_discards_gradients_no_later_backward_overwrites(dist, path_name):
    dist.run(scenarios.zero_grad_discards_what_no_later_backward_overwrites, path_name)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", cases(*FP16_DYNAMIC))
def test_fp16_overflow_skips_the_step_and_clears_the_accumulation(dist, path_name):
    dist.run(scenarios.fp16_overflow_inside_accumulation, path_name)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", cases("fp32-deepspeed-optimizer", "bf16", "zero1-fp32",
                                            "zero1-bf16-fp32-accumulation", "fp16-unfused", "moe", "zero2-fp32",
                                            "zero2-overlap-comm", "zero2-bf16", "zero3-fp32",
                                            "zero3-persistent-and-partitioned", "zero3-bf16"))
def test_checkpoint_round_trip_reproduces_an_uninterrupted_run(dist, path_name, tmp_path):
    dist.run(scenarios.checkpoint_round_trip, path_name, str(tmp_path))


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("path_name", cases("zero2-wide", "zero2-wide-overlap-comm", "zero3-wide"))
def test_gradient_memory_held_across_backwards_equals_managed(dist, path_name):
    managed = dist.run(scenarios.gradient_bytes_held_across_backwards, path_name, True, 4)
    unmanaged = dist.run(scenarios.gradient_bytes_held_across_backwards, path_name, False, 4)
    # In flight at most: a 20000-element reduce bucket, or the wide model's 256x256 layer's gradient (larger than the
    # bucket, so reduced on its own: once seen held after an unmanaged backward, 262144 bytes).
    assert_same_gradient_memory(managed, unmanaged, in_flight_bytes=4 * max(20000, 256 * 256))


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", cases("zero3-fp32", "zero3-bf16"))
def test_16bit_model_export_after_unmanaged_steps(dist, path_name, tmp_path):
    dist.run(scenarios.sixteen_bit_export_parity, path_name, str(tmp_path))


def _throughput_reports_the_step(n: int) -> dict:
    """Every forward takes >= 30 ms; with gradient_accumulation_steps=2 configured, a step runs n forwards and
    backwards. The throughput timer must time the whole step and count its n micro-batches (0.19.3's timer,
    restarted at every forward and counting the configured batch, reports about 2n/n x too much here)."""
    import time

    import deepspeed.comm as ds_comm

    from ds_harness.support.paths import PATHS
    from ds_harness.support.training import MICRO_BATCH, destroy, run_unmanaged

    engine = PATHS["zero1-fp32"].initialize(gas=2, managed=False)
    engine.module.register_forward_pre_hook(lambda *_: time.sleep(0.03))
    run_unmanaged(engine, [n] * 5, divide_by_n=True)
    samples = MICRO_BATCH * ds_comm.get_world_size() * n
    result = {"batch_size": engine.tput_timer.batch_size, "samples": samples,
              "measured": engine.tput_timer.avg_samples_per_sec(), "bound": samples / (n * 0.03)}
    destroy(engine)
    return result


@pytest.mark.base("0.19.3", reason="a promise of the 0.19.3 series only; the 0.19.8 follow-ups leave it to "
                   "upstream")
@pytest.mark.pr("zero-0-1")
@pytest.mark.world_size(1, 2)
def test_throughput_counts_the_samples_and_time_of_the_whole_step(dist):
    for result in dist.run(_throughput_reports_the_step, 4):
        assert result["batch_size"] == result["samples"], result
        assert 0 < result["measured"] <= result["bound"], result


def _autotuning_metrics_report_the_step(metric_dir: str, n: int) -> dict | None:
    """Autotuning profiles one step and exits with its latency, FLOPS and throughput. With
    gradient_accumulation_steps=2 configured, the profiled step runs n forwards of >= 30 ms each: the metrics
    must cover that step's time and its n micro-batches (0.19.3's exit multiplies one micro-step's mean time, the
    flops of one forward and the batch by the configured 2)."""
    import json
    import os
    import time

    import deepspeed.comm as ds_comm

    from ds_harness.support.paths import PATHS
    from ds_harness.support.training import MICRO_BATCH, destroy, run_unmanaged

    metric_path = os.path.join(metric_dir, "autotuning_metric.json")
    engine = PATHS["zero1-fp32"].initialize(gas=2,
                                            managed=False,
                                            autotuning={"enabled": True, "start_profile_step": 1,
                                                        "end_profile_step": 1, "metric_path": metric_path})
    engine.module.register_forward_pre_hook(lambda *_: time.sleep(0.03))
    run_unmanaged(engine, [1], divide_by_n=True)
    started = time.time()
    with pytest.raises(SystemExit):  # autotuning's exit after the profiled step
        run_unmanaged(engine, [n], first_step=1, divide_by_n=True)
    wall = time.time() - started
    flops = getattr(engine, "flops", None)
    destroy(engine)
    if ds_comm.get_rank() != 0:
        return None
    with open(metric_path) as f:
        metrics = json.load(f)
    return {"metrics": metrics, "wall_us": wall * 1e6, "flops": flops,
            "samples": MICRO_BATCH * ds_comm.get_world_size() * n}


@pytest.mark.base("0.19.3", reason="a promise of the 0.19.3 series only; the 0.19.8 follow-ups leave it to "
                   "upstream")
@pytest.mark.pr("zero-0-1")
@pytest.mark.world_size(1, 2)
def test_autotuning_metrics_count_the_time_and_samples_of_the_profiled_step(dist, tmp_path):
    n = 4
    result = dist.run(_autotuning_metrics_report_the_step, str(tmp_path), n)[0]
    metrics, latency = result["metrics"], result["metrics"]["latency"]
    # The n forwards alone take n x 30 ms; the timers are parts of the step's wall time
    assert n * 30_000 <= latency <= result["wall_us"], result
    # The engine's own formulas over the step's own samples and backward count: exact.
    assert metrics["throughput"] == result["samples"] * 1_000_000 / latency, result
    assert metrics["FLOPS_per_gpu"] == result["flops"] * 1_000_000 * n / latency, result


def _finalize_hook_body(path_name: str) -> None:
    """step() calls the finalize hook that ZeROOptimizer declares, once, inside the boundary, on every ZeRO
    optimizer (ZeRO-1 and BF16_Optimizer included, whose gradients the engine reduces)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from ds_harness.support.paths import PATHS
    from ds_harness.support.training import destroy, run_unmanaged

    assert "finalize_gradient_accumulation_boundary" in ZeROOptimizer.__dict__
    # Stage 3 has no boundary-time work of its own: its no-op is the base's
    assert "finalize_gradient_accumulation_boundary" not in DeepSpeedZeroOptimizer_Stage3.__dict__
    engine = PATHS[path_name].initialize(gas=1, managed=False)
    assert isinstance(engine.optimizer, ZeROOptimizer)
    hook, calls = engine.optimizer.finalize_gradient_accumulation_boundary, []

    def observed_hook():
        calls.append(engine.is_gradient_accumulation_boundary())
        return hook()

    engine.optimizer.finalize_gradient_accumulation_boundary = observed_hook
    run_unmanaged(engine, [2, 1])
    destroy(engine)
    assert calls == [True, True], calls


@pytest.mark.base("0.19.3", reason="checks the 0.19.3 series' internals (its private methods and hooks)")
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", cases("zero1-fp32", "zero1-bf16-fp32-accumulation", "zero2-fp32", "zero3-fp32"))
def test_step_calls_the_declared_finalize_hook_of_every_zero_optimizer(dist, path_name):
    dist.run(_finalize_hook_body, path_name)
