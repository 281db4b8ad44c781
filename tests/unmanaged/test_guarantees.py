"""PRs 1-3: what unmanaged mode promises besides parity - boundary, bookkeeping, discard, fp16 overflow,
checkpoints, memory, 16-bit export - on every ZeRO stage."""

import pytest

from support import scenarios
from support.cases import cases
from support.memory_assertions import assert_same_gradient_memory
from support.paths import FP16_DYNAMIC, ZERO_0_1_PATHS, ZERO_2_PATHS, ZERO_3_PATHS

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


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", cases("zero1-fp32", "zero2-fp32", "zero3-fp32"))
def test_torch_style_backward_accumulates_like_engine_backward(dist, path_name):
    dist.run(scenarios.torch_style_backward_parity, path_name)


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", cases(*ALL))
def test_zero_grad_discards_a_partial_accumulation(dist, path_name):
    dist.run(scenarios.zero_grad_discards, path_name)


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
    assert_same_gradient_memory(managed, unmanaged, bucket_bytes=4 * 20000)


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
    from support.paths import PATHS
    from support.training import MICRO_BATCH, destroy, run_unmanaged

    engine = PATHS["zero1-fp32"].initialize(gas=2, managed=False)
    engine.module.register_forward_pre_hook(lambda *_: time.sleep(0.03))
    run_unmanaged(engine, [n] * 5, divide_by_n=True)
    samples = MICRO_BATCH * ds_comm.get_world_size() * n
    result = {"batch_size": engine.tput_timer.batch_size, "samples": samples,
              "measured": engine.tput_timer.avg_samples_per_sec(), "bound": samples / (n * 0.03)}
    destroy(engine)
    return result


@pytest.mark.pr("zero-0-1")
@pytest.mark.world_size(1, 2)
def test_throughput_counts_the_samples_and_time_of_the_whole_step(dist):
    for result in dist.run(_throughput_reports_the_step, 4):
        assert result["batch_size"] == result["samples"], result
        assert 0 < result["measured"] <= result["bound"], result
