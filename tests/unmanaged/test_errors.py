"""PR 1: the flag's config contract and every clear error unmanaged mode raises, as early as possible."""

import pytest
import torch

from support.paths import PATHS as ZERO_0_1_PATHS
from support.training import backward, base_config, destroy, forward_loss, initialize, run_unmanaged

pytestmark = [pytest.mark.pr(1), pytest.mark.world_size(1, 2)]

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


@pytest.mark.parametrize("value,expected", [("absent", True), (True, True), (False, False), ("false", None),
                                            ("true", None), (0, None), (1, None), (None, None)])
def test_flag_accepts_only_json_booleans(dist, value, expected):
    dist.run(_config_value_body, value, expected)


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


@pytest.mark.parametrize("name", sorted(CONFLICTS))
def test_options_that_cannot_work_are_rejected_at_initialize(dist, name):
    dist.run(_conflict_body, name)


def _overlap_comm_stage0_body() -> None:
    # Stage 0 has no ZeRO reducer: overlap_comm is ignored there, in both modes.
    engine = initialize(base_config(1, managed=False, zero_optimization={"stage": 0, "overlap_comm": True}))
    run_unmanaged(engine, [2])
    destroy(engine)


def test_overlap_comm_is_harmless_at_stage_0(dist):
    dist.run(_overlap_comm_stage0_body)


def _pipeline_body() -> None:
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.config import DeepSpeedConfigError

    import deepspeed

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
    with pytest.raises(RuntimeError, match=f"{FLAG}=false but no backward"):
        engine.step()
    run_unmanaged(engine, [2])
    with pytest.raises(RuntimeError, match=f"{FLAG}=false but no backward"):
        engine.step()
    if engine.zero_optimization_stage() == 1:
        with pytest.raises(RuntimeError, match=f"coalesce_grad_reduction.*{FLAG}=false"):
            with engine.coalesce_grad_reduction():
                pass
    backward(engine, forward_loss(engine, 3, 0))
    backward(engine, forward_loss(engine, 3, 1))
    with pytest.raises(RuntimeError, match=r"drop the gradients of 2 backward pass\(es\)"):
        engine.save_checkpoint(save_dir)
    engine.step()
    engine.save_checkpoint(save_dir)
    destroy(engine)


@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero1-fp32"])
def test_misuse_at_runtime_raises_clear_errors(dist, path_name, tmp_path):
    dist.run(_runtime_errors_body, path_name, str(tmp_path))
