"""`zero-0-1`: the flag's config contract and every clear error unmanaged mode raises, as early as possible."""


import pytest
import torch

from ds_harness.support.paths import PATHS as ZERO_0_1_PATHS
from ds_harness.support.training import backward, base_config, destroy, forward_loss, initialize, run_unmanaged

pytestmark = [pytest.mark.pr("zero-0-1"), pytest.mark.world_size(1, 2)]

FLAG = "managed_gradient_accumulation"


def _config_value_body(value, expected) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    config = base_config(1)
    if value != "absent":
        config[FLAG] = value
    if expected is None:
        with pytest.raises(DeepSpeedConfigError, match=f"{FLAG} must be a boolean"):
            DeepSpeedConfig(config)
    else:
        assert DeepSpeedConfig(config).managed_gradient_accumulation is expected


@pytest.mark.base("0.19.3", reason="the 0.19.3 series adds the flag, so it can refuse every non-boolean; 0.19.8 "
                  "already reads one for its truthiness")
@pytest.mark.parametrize("value,expected", [("absent", True), (True, True), (False, False), ("false", None),
                                            ("true", None), (0, None), (1, None), (None, None)])
def test_flag_accepts_only_json_booleans(dist, value, expected):
    dist.run(_config_value_body, value, expected)


def _truthy_value_body(value) -> list[str]:
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger

    config = base_config(1)
    config[FLAG] = value
    lines = []
    original = logger.warning
    logger.warning = lambda msg, *a, **k: lines.append(str(msg))
    try:
        managed = DeepSpeedConfig(config).managed_gradient_accumulation
    finally:
        logger.warning = original
    assert managed is bool(value), "a non-boolean is read for its truthiness, as 0.19.8 reads it"
    return [line for line in lines if FLAG in line]


@pytest.mark.base("0.19.8", reason="0.19.8 already reads a non-boolean flag for its truthiness")
@pytest.mark.pr("unmanaged-flag-validation")
@pytest.mark.parametrize("value,expected", [("absent", True), (True, True), (False, False)])
def test_boolean_flag_on_0_19_8(dist, value, expected):
    dist.run(_config_value_body, value, expected)


@pytest.mark.base("0.19.8", reason="0.19.8 already reads a non-boolean flag for its truthiness")
@pytest.mark.pr("unmanaged-flag-validation")
@pytest.mark.parametrize("value", ["false", "true", 1, 0, None, ""])
def test_non_boolean_flag_read_for_its_truthiness_with_a_warning(dist, value):
    """Every config 0.19.8 accepts starts in the same mode: a non-boolean is read for its truthiness, with a warning
    on rank 0 saying how it was read (the string "false" is read as true) and what selects unmanaged mode."""
    warned = dist.run(_truthy_value_body, value)
    first = warned[0]
    read_as = f"read as {str(bool(value)).lower()}"
    assert len(first) == 1 and read_as in first[0] and repr(value) in first[0], warned
    assert 'The string "false" is read as true' in first[0] and "JSON boolean false" in first[0], warned
    assert not any(warned[1:]), warned


def _accessor_and_print_body() -> list:
    from deepspeed.utils import logger

    engine = initialize(base_config(1, managed=False))
    assert engine.managed_gradient_accumulation() is False
    lines = []
    original = logger.info
    logger.info = lambda msg, *a, **k: lines.append(str(msg))
    try:
        engine._config.print("DeepSpeedEngine configuration")
    finally:
        logger.info = original
    destroy(engine)
    return [line for line in lines if FLAG in line]


def test_flag_is_exposed_and_printed(dist):
    printed = dist.run(_accessor_and_print_body)[0]
    assert any(line.split()[0] == FLAG and line.split()[-1] == "False" for line in printed), printed


CONFLICTS = {
    "amp": ({"amp": {"enabled": True}}, "amp"),
    "deepcompile": ({"compile": {"deepcompile": True}}, "compile.deepcompile"),
    "zenflow": ({"zero_optimization": {"stage": 1, "zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow"),
    "zero1-overlap-comm": ({"zero_optimization": {"stage": 1, "overlap_comm": True}}, "overlap_comm"),
}


def _conflict_body(name: str) -> None:
    from deepspeed.runtime.config import DeepSpeedConfigError

    extra, option = CONFLICTS[name]
    with pytest.raises(DeepSpeedConfigError) as error:
        initialize(base_config(1, managed=False, **extra))
    message = str(error.value)
    assert f"{FLAG}=false" in message and option in message, message


@pytest.mark.base("0.19.3", reason="a promise of the 0.19.3 series only; the 0.19.8 follow-ups leave it to "
                   "upstream")
@pytest.mark.parametrize("name", sorted(CONFLICTS))
def test_options_that_cannot_work_are_rejected_at_initialize(dist, name):
    dist.run(_conflict_body, name)


def _overlap_comm_stage0_body() -> None:
    # Stage 0 has no ZeRO reducer: overlap_comm is ignored there, in both modes.
    engine = initialize(base_config(1, managed=False, zero_optimization={"stage": 0, "overlap_comm": True}))
    run_unmanaged(engine, [2])
    destroy(engine)


@pytest.mark.base("0.19.3", reason="a promise of the 0.19.3 series only; the 0.19.8 follow-ups leave it to "
                   "upstream")
def test_overlap_comm_is_harmless_at_stage_0(dist):
    dist.run(_overlap_comm_stage0_body)


def _pipeline_body() -> None:
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.config import DeepSpeedConfigError

    torch.manual_seed(0)
    model = PipelineModule(layers=[torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)], num_stages=1,
                           loss_fn=torch.nn.MSELoss())
    with pytest.raises(DeepSpeedConfigError, match=f"{FLAG}=false is not supported with pipeline parallelism"):
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=base_config(1, managed=False))


def test_pipeline_parallelism_is_rejected_at_initialize(dist):
    dist.run(_pipeline_body)


def _runtime_errors_body(path_name: str, save_dir: str) -> None:
    engine = ZERO_0_1_PATHS[path_name].initialize(gas=1, managed=False)
    with pytest.raises(RuntimeError, match=f"set_gradient_accumulation_boundary.*{FLAG}=false"):
        engine.set_gradient_accumulation_boundary(True)
    # At stages 0 and 1 a step() without backward steps on zero gradients, with a warning
    engine.step()
    assert engine.global_steps == 1
    run_unmanaged(engine, [2])
    if engine.zero_optimization_stage() == 1:
        with pytest.raises(RuntimeError, match=f"coalesce_grad_reduction.*{FLAG}=false"):
            with engine.coalesce_grad_reduction():
                pass
    backward(engine, forward_loss(engine, 3, 0))
    backward(engine, forward_loss(engine, 3, 1))
    with pytest.raises(RuntimeError,
                       match=r"(drop|leave out of the checkpoint) the gradients of 2 backward pass\(es\)"):
        engine.save_checkpoint(save_dir)
    engine.step()
    engine.save_checkpoint(save_dir)
    destroy(engine)


@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero1-fp32"])
def test_misuse_at_runtime_raises_clear_errors(dist, path_name, tmp_path):
    dist.run(_runtime_errors_body, path_name, str(tmp_path))


# -- errors that depend on per-rank state: raised on every rank together, never a hang ----------------------
def _count_all_reduces():
    """A context counting deepspeed.comm.all_reduce calls (the step's checks use one)."""
    import contextlib

    import deepspeed.comm as ds_comm

    @contextlib.contextmanager
    def counting():
        calls = []
        original = ds_comm.all_reduce

        def all_reduce(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        ds_comm.all_reduce = all_reduce
        try:
            yield calls
        finally:
            ds_comm.all_reduce = original

    return counting()


def _load_checkpoint_refuses_pending_body(save_dir: str) -> None:
    engine = ZERO_0_1_PATHS["zero1-fp32"].initialize(gas=1, managed=False)
    run_unmanaged(engine, [1])
    engine.save_checkpoint(save_dir, tag="one")
    backward(engine, forward_loss(engine, 5, 0))
    with pytest.raises(RuntimeError, match=f"load_checkpoint\\(\\).*{FLAG}=false|{FLAG}=false.*load_checkpoint"):
        engine.load_checkpoint(save_dir, tag="one")
    # The pending backward is kept, the caller decides: step() applies it (it would refuse a step with none).
    engine.step()
    destroy(engine)


def test_load_checkpoint_with_pending_backwards_is_refused(dist, tmp_path):
    dist.run(_load_checkpoint_refuses_pending_body, str(tmp_path))


def _step_order_body() -> None:
    from deepspeed.utils.timer import BACKWARD_GLOBAL_TIMER, BACKWARD_REDUCE_GLOBAL_TIMER

    engine = ZERO_0_1_PATHS["fp32-deepspeed-optimizer"].initialize(gas=1, managed=False, wall_clock_breakdown=True)
    backward(engine, forward_loss(engine, 0, 0))
    timers, timed = [engine.timers(name) for name in (BACKWARD_GLOBAL_TIMER, BACKWARD_REDUCE_GLOBAL_TIMER)], []
    finalize = engine._finalize_gradient_accumulation

    def observed_finalize():
        timed.append([timer.started_ for timer in timers])
        return finalize()

    engine._finalize_gradient_accumulation = observed_finalize
    with _count_all_reduces() as calls:
        engine.step()
    assert calls, "the step must reduce"
    # Managed mode times the reduction inside the boundary backward: in the backward timers, which the flops
    # profiler and autotuning read, and in the backward-reduce timers
    assert timed == [[True, True]], f"the unmanaged reduction is not timed as the backward reduction: {timed}"

    # A reduction that raises stops its timers: the next backward and step() run (a started timer would refuse
    # to start again)
    def failing_finalize():
        raise RuntimeError("reduction failure")

    engine._finalize_gradient_accumulation = failing_finalize
    backward(engine, forward_loss(engine, 1, 0))
    with pytest.raises(RuntimeError, match="reduction failure"):
        engine.step()
    assert not any(timer.started_ for timer in timers)
    engine._finalize_gradient_accumulation = finalize
    engine.zero_grad()
    backward(engine, forward_loss(engine, 2, 0))
    engine.step()
    destroy(engine)


@pytest.mark.base("0.19.3", reason="a promise of the 0.19.3 series only; the 0.19.8 follow-ups leave it to "
                   "upstream")
def test_unmanaged_reduction_is_timed_as_the_backward_reduction(dist):
    dist.run(_step_order_body)


def _failed_step_is_dropped_body(path_name: str) -> None:
    """An optimizer that raises inside step(), after the reduction: the step's gradients are dropped, so the next
    backward() and step() apply exactly what a fresh engine applies for that backward (a retry would reduce the
    failed step's gradients again and add the new ones to them), and no step timer is left running (with
    wall_clock_breakdown a started timer refuses to start again)."""
    from ds_harness.support.training import assert_identical, snapshot

    engines = [ZERO_0_1_PATHS[path_name].initialize(gas=1, managed=False, wall_clock_breakdown=True) for _ in "ab"]
    failing, reference = engines
    step = failing.optimizer.step

    def failing_step(*args, **kwargs):
        raise RuntimeError("optimizer failure")

    failing.optimizer.step = failing_step
    backward(failing, forward_loss(failing, 0, 0))
    with pytest.raises(RuntimeError, match="optimizer failure"):
        failing.step()
    failing.optimizer.step = step
    for engine in engines:
        backward(engine, forward_loss(engine, 1, 0))
        engine.step()
    assert_identical(snapshot(failing), snapshot(reference), "after a failed step()", ignore=("global_steps", ))
    destroy(*engines)


@pytest.mark.base("0.19.3", reason="the 0.19.8 series' unmanaged-step-checks has its own test")
@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero1-fp32", "bf16"])
def test_a_failed_step_drops_its_gradients_and_leaves_the_engine_usable(dist, path_name):
    dist.run(_failed_step_is_dropped_body, path_name)


def _pending_checkpoint_errors_body(save_dir: str) -> list:
    """save_checkpoint() and load_checkpoint() with a pending backward pass on rank 0 only raise on every rank."""
    import deepspeed.comm as ds_comm

    engine = ZERO_0_1_PATHS["zero1-fp32"].initialize(gas=1, managed=False)
    run_unmanaged(engine, [1])
    engine.save_checkpoint(save_dir, tag="clean")
    if ds_comm.get_rank() == 0:
        backward(engine, forward_loss(engine, 2, 0))
    messages = []
    for call in (lambda: engine.save_checkpoint(save_dir, tag="pending"),
                 lambda: engine.load_checkpoint(save_dir, tag="clean")):
        with pytest.raises(RuntimeError, match=r"1 backward pass.* since the last step\(\)") as error:
            call()
        messages.append(str(error.value))
    engine.zero_grad()
    engine.load_checkpoint(save_dir, tag="clean")
    destroy(engine)
    return messages


@pytest.mark.world_size(2)
def test_pending_checkpoint_errors_are_raised_on_every_rank(dist, tmp_path):
    messages = dist.run(_pending_checkpoint_errors_body, str(tmp_path))
    assert messages[0] == messages[1], messages


def _no_sync_on_one_rank_body() -> str | None:
    """The rank inside no_sync() raises before any collective; its peer waits in the gradient reduction until that
    rank leaves no_sync() and steps."""
    import contextlib

    import deepspeed.comm as ds_comm

    engine = ZERO_0_1_PATHS["fp32-deepspeed-optimizer"].initialize(gas=1, managed=False)
    backward(engine, forward_loss(engine, 0, 0))
    message = None
    with engine.no_sync() if ds_comm.get_rank() == 0 else contextlib.nullcontext():
        if ds_comm.get_rank() == 0:
            with _count_all_reduces() as calls:
                with pytest.raises(RuntimeError, match=f"step\\(\\) inside no_sync\\(\\) with {FLAG}=false") as error:
                    engine.step()
            assert not calls, f"{len(calls)} all-reduces before the refusal"
            message = str(error.value)
    engine.step()
    assert engine.global_steps == 1
    destroy(engine)
    return message


@pytest.mark.world_size(2)
def test_step_inside_no_sync_is_refused_on_that_rank_before_any_collective(dist):
    messages = dist.run(_no_sync_on_one_rank_body)
    assert messages[0] and messages[1] is None, messages


def _mics_replication_body() -> None:
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    world = ds_comm.get_world_size()
    for shard_size in (1, world):
        config = base_config(1, managed=False, stage=3, zero_optimization={"mics_shard_size": shard_size})
        if shard_size < world:
            with pytest.raises(DeepSpeedConfigError, match=f"{FLAG}=false.*zero_optimization.mics_shard_size"):
                DeepSpeedConfig(config)
        else:
            DeepSpeedConfig(config)  # one shard group: no cross-replica reduction to miss
        config[FLAG] = True
        DeepSpeedConfig(config)  # managed mode accepts both


@pytest.mark.base("0.19.3", reason="DeepSpeed 0.19.8 removed MiCS")
@pytest.mark.pr("zero-3")
@pytest.mark.world_size(2)
def test_mics_with_replication_is_rejected(dist):
    dist.run(_mics_replication_body)
