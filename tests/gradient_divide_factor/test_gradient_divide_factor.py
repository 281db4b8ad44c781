"""`gradient-divide-factor`: step(gradient_divide_factor=...) normalises the summed gradient once per step, on every
stage."""

import pytest
import torch

from ds_harness.support import scenarios
from ds_harness.support.divisor import divisor_config, divisor_step_kwargs

pytestmark = pytest.mark.pr("gradient-divide-factor")

#: Every way the factor is applied: folded into the loss-scale division of the ZeRO optimizers (fp32, bf16,
#: fp16, CPU and NVMe offload) and of the fused FP16 optimizer; folded into the averaging of the step's
#: all-reduce for the BF16 optimizer, the unfused FP16 optimizer and fp32 without ZeRO (DeepSpeed's and a
#: client optimizer).
STAGE_PATHS = ["fp32-deepspeed-optimizer", "fp32-client-optimizer", "bf16", "fp16-fused", "fp16-unfused",
               "zero1-fp32", "zero1-bf16-fp32-accumulation", "zero1-fp16", "zero2-fp32", "zero2-overlap-comm",
               "zero2-bf16", "zero2-fp16", "zero3-fp32", "zero3-bf16", "zero3-fp16", "zero1-offload",
               "zero2-offload", "zero3-offload", "zero3-offload-param", "zero3-offload-nvme"]


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("path_name", STAGE_PATHS)
def test_token_sums_divided_by_global_token_count_give_the_token_mean(dist, path_name):
    dist.run(scenarios.token_mean_matches_full_batch_and_predivided, path_name, [1, 3, 2, 5])


@pytest.mark.world_size(1, 2, 4)
@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero1-fp32", "zero2-fp32", "zero3-fp32"])
@pytest.mark.parametrize("n", [4, 3])  # 4: bitwise equal (powers of two); 3: up to rounding
def test_micro_batch_mean_recipe_equals_managed_gas_n(dist, path_name, n):
    dist.run(scenarios.micro_batch_mean_recipe_equals_managed, path_name, n)


@pytest.mark.world_size(1, 2)
# One path per way of applying the factor that records a norm: the BF16 optimizer (all-reduce), ZeRO.
@pytest.mark.parametrize("path_name", ["bf16", "zero2-fp32", "zero3-fp32"])
def test_norm_and_clipping_see_the_normalised_gradient(dist, path_name):
    dist.run(scenarios.clipping_sees_the_normalised_gradient, path_name)


@pytest.mark.base("0.19.3", reason="the 0.19.3 series' global factor; the 0.19.8 series' per-rank count is tested in "
                  "its PR's own test module")
@pytest.mark.world_size(1, 2)
# Both ways of applying the factor: the all-reduce's averaging (fp32 without ZeRO), the ZeRO optimizer's ratio
@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero2-fp32"])
def test_the_factor_lasts_one_step(dist, path_name):
    dist.run(scenarios.factor_lasts_one_step, path_name)


@pytest.mark.base("0.19.3", reason="the 0.19.3 series' global factor; the 0.19.8 series' per-rank count is tested in "
                  "its PR's own test module")
@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("path_name", ["zero1-fp32", "zero3-fp32"])
def test_a_factor_differing_across_ranks_raises_on_every_rank(dist, path_name):
    messages = dist.run(scenarios.factor_differing_across_ranks_raises_everywhere, path_name)
    assert len(set(messages)) == 1, messages


@pytest.mark.base("0.19.3", reason="the 0.19.3 series' global factor; the 0.19.8 series' per-rank count is tested in "
                  "its PR's own test module")
@pytest.mark.world_size(1)
def test_invalid_factors_and_managed_mode_are_errors(dist):
    dist.run(scenarios.factor_errors, "zero1-fp32")


@pytest.mark.base("0.19.3", reason="a promise of the 0.19.3 series only: the 0.19.8 follow-ups do not warn about "
                   "GAS-scaled losses")
@pytest.mark.world_size(1, 2)
def test_gas_scaling_mismatch_warns_once_exactly_when_it_should(dist):
    counts = dist.run(scenarios.gas_scaling_mismatch_warnings, "zero1-fp32")
    assert counts == [[0, 0, 0, 0, 1, 0]] + [[0] * 6] * (dist.world_size - 1), "once, on rank 0 only"


@pytest.mark.base("0.19.3", reason="the 0.19.3 series' global factor; the 0.19.8 series' per-rank count is tested in "
                  "its PR's own test module")
@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero2-fp32", "zero3-fp32"])
def test_a_factor_wrong_on_one_rank_raises_on_every_rank(dist, path_name):
    messages = dist.run(scenarios.factor_errors_on_one_rank, path_name)
    assert "got a tensor of shape (2,)" in messages[0][0] and "invalid on another" in messages[1][0]
    assert "positive and finite" in messages[0][1] and "invalid on another" in messages[1][1]
    assert len(messages[0]) == 2


@pytest.mark.base("0.19.3", reason="a promise of the 0.19.3 series' gradient-divide-factor")
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero2-fp32"])
def test_bools_and_non_scalar_tensors_are_refused(dist, path_name):
    messages = dist.run(scenarios.factor_type_errors, path_name)
    assert all("boolean" in m for m in messages[0][:2]), messages[0]
    assert "shape (1,)" in messages[0][2] and "shape (1, 1)" in messages[0][3], messages[0]


@pytest.mark.base("0.19.3", reason="the 0.19.8 series' gradient-divide-factor does not read the factor this way")
@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero3-fp32"])
def test_an_unreadable_factor_on_one_rank_raises_on_every_rank(dist, path_name):
    messages = dist.run(scenarios.factor_errors_on_one_rank, path_name, "unreadable")
    assert "meta" in messages[0][0] and "complex" in messages[0][1].lower(), messages[0]
    assert all("invalid on another" in m for m in messages[1]), messages[1]


VOCABULARY = 16


class _EmbeddingMLP(torch.nn.Module):
    """TinyMLP with an embedding of token ids read off the inputs. Its gradient is sparse (``sparse=True``): the
    engine all-reduces it as a sparse tensor (only the rows the batch used), with no config flag (DeepSpeed 0.19.8
    removed ``sparse_gradients``, which compressed dense embedding gradients)."""

    def __init__(self) -> None:
        super().__init__()
        from ds_harness.support.training import FEATURES, HIDDEN, OUTPUTS

        self.embed = torch.nn.Embedding(VOCABULARY, HIDDEN, sparse=True)
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x[:, 0].abs() * 7).long() % VOCABULARY
        return self.fc2(torch.nn.functional.gelu(self.fc1(x) + self.embed(ids)))


def _make_embedding_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return _EmbeddingMLP()


def _sparse_gradients_take_the_factor() -> None:
    """The factor replaces the data-parallel averaging of sparse gradients too (the engine's sparse all-reduce):
    raw losses with the factor 2 * dp_world_size equal halved losses without one, bitwise (powers of two scale
    exactly), in the embedding as in the dense layers. SGD, which takes sparse gradients, as a client optimizer."""
    from ds_harness.support.paths import Path
    from ds_harness.support.training import assert_identical, destroy, forward_loss, snapshot

    path = Path(0, "fp32", {"optimizer": None}, lambda: {"optimizer": lambda params: torch.optim.SGD(params, lr=0.05)},
                model_fn=_make_embedding_model)
    runs = []
    for with_factor in (True, False):
        engine = path.initialize(gas=1, managed=False, **(divisor_config() if with_factor else {}))
        for step in range(3):
            for i in range(2):
                loss = forward_loss(engine, step, i)
                engine.backward(loss if with_factor else loss * 0.5, scale_wrt_gas=False)
            assert engine.module.embed.weight.grad.is_sparse
            if with_factor:
                engine.step(**divisor_step_kwargs(2.0 * engine.dp_world_size, 2))
            else:
                engine.step()
        runs.append(snapshot(engine))
        destroy(engine)
    assert_identical(runs[1], runs[0], "raw losses with the factor 2 * dp_world_size vs halved losses")


@pytest.mark.world_size(1, 2)
def test_sparse_gradients_take_the_factor(dist):
    dist.run(_sparse_gradients_take_the_factor)


def _legacy_fused_sgd(params):
    """A FusedAdam (so DeepSpeed picks the fused FP16_Optimizer) with the legacy fused interface that
    ``"optimizer": {"legacy_fusion": true}`` drives (FP16_Optimizer.step_fused_adam()): it gets the flat fp16
    gradients, the combined loss/clipping scale and the fp16 parameters to write. DeepSpeed's own FusedAdam
    refuses those arguments (apex's legacy FusedAdam took them), so the update is written here: plain SGD."""
    from deepspeed.ops.adam import FusedAdam

    class LegacyFusedSGD(FusedAdam):

        def __init__(self, params, lr=1e-2):
            torch.optim.Optimizer.__init__(self, params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None, grads=None, output_params=None, scale=1.0, grad_norms=None, **kwargs):
            if grads is None:  # the plain interface, which FP16_Optimizer uses once to create optimizer state
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-group["lr"])
                return
            for group, group_grads, group_out in zip(self.param_groups, grads, output_params):
                for p, g, out in zip(group["params"], group_grads, group_out):
                    p.add_(g.float() / scale, alpha=-group["lr"])
                    out.copy_(p)

    return LegacyFusedSGD(params)


def _legacy_fused_norm_is_normalised() -> None:
    """(c) on the legacy fused FP16 path: raw token-sum losses with the global token count as the factor report
    the gradient norm of pre-divided losses with the factor 1 (the norm of the normalised gradient), as the
    other fp16 paths do; without the factor in it, the raw run's norm is tokens / dp_world_size times larger."""
    from ds_harness.support.paths import Path
    from ds_harness.support.training import destroy

    path = Path(0,
                "fp16", {"optimizer": {
                    "type": None,
                    "params": None,
                    "legacy_fusion": True
                }},
                lambda: {"optimizer": _legacy_fused_sgd},
                needs_fp16=True)
    norms = {}
    for predivide in (False, True):
        engine = path.initialize(gas=1, managed=False)
        assert engine.optimizer.fused_adam_legacy, "the engine must take the legacy fused FP16 path"
        norms[predivide] = []
        for step, n in enumerate([2, 3]):
            tokens = scenarios._global_tokens(n, step)
            for i in range(n):
                loss, _ = scenarios._token_sum_loss(engine, step, i)
                engine.backward(loss / tokens if predivide else loss, scale_wrt_gas=False)
            engine.step(gradient_divide_factor=1.0 if predivide else tokens)
            assert engine.skipped_steps == 0
            norms[predivide].append(float(engine.get_global_grad_norm()))
        destroy(engine)
    # The two runs' fp16 gradients round differently (losses scaled before or after backward): two fp16 ulps
    torch.testing.assert_close(torch.tensor(norms[False]), torch.tensor(norms[True]),
                               rtol=2 * torch.finfo(torch.float16).eps, atol=0)


@pytest.mark.base("0.19.3", reason="the 0.19.3 series' global factor; the 0.19.8 series' per-rank count is tested in "
                  "its PR's own test module")
@pytest.mark.world_size(1, 2)
def test_legacy_fused_fp16_norm_sees_the_normalised_gradient(dist):
    dist.run(_legacy_fused_norm_is_normalised)


def _hybrid_engine_takes_the_factor() -> None:
    """DeepSpeedHybridEngine (RLHF) overrides step(): it must take and forward the factor. Its step() body is
    run on an unmanaged engine with the hybrid engine's inference state empty (building a real hybrid engine
    needs an inference-capable model), against the plain engine's step()."""
    import torch
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

    from ds_harness.support.paths import PATHS
    from ds_harness.support.training import destroy, forward_loss, snapshot

    results = []
    for hybrid in (True, False):
        engine = PATHS["zero2-fp32"].initialize(gas=1, managed=False)
        for i in range(3):
            engine.backward(forward_loss(engine, 0, i), scale_wrt_gas=False)
        if hybrid:
            engine.__class__ = DeepSpeedHybridEngine
            engine._inference_containers, engine.Z3_enabled, engine._training_start_time = [], False, None
        engine.step(gradient_divide_factor=torch.tensor(6.0))
        results.append(snapshot(engine).params)
        destroy(engine)
    for name, p in results[1].items():
        assert torch.equal(results[0][name], p), name


@pytest.mark.base("0.19.3", reason="the 0.19.3 series' global factor; the 0.19.8 series' per-rank count is tested in "
                  "its PR's own test module")
@pytest.mark.world_size(2)
def test_hybrid_engine_step_takes_the_factor(dist):
    dist.run(_hybrid_engine_takes_the_factor)


def _divide_ratio_declarations_body(path_name: str) -> str:
    """Which optimizers apply gradient_divide_ratio is declared on the classes, not guessed from attributes; a
    ZeRO-2/3 optimizer that reduces the gradients itself without applying it is refused on every rank, not
    silently given an unnormalised gradient."""
    import torch
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from ds_harness.support.paths import PATHS
    from ds_harness.support.training import destroy, forward_loss, snapshot

    assert "gradient_divide_ratio" in DeepSpeedOptimizer.__dict__
    from deepspeed.runtime.superoffload.superoffload_stage3 import SuperOffloadOptimizer_Stage3
    from deepspeed.runtime.zenflow.zenflow_stage_1_and_2 import ZenFlowZeroOptimizer

    classes = (DeepSpeedOptimizer, ZeROOptimizer, FP16_Optimizer, FP16_UnfusedOptimizer, BF16_Optimizer,
               ZenFlowZeroOptimizer, SuperOffloadOptimizer_Stage3)
    declared = {cls: cls.applies_gradient_divide_ratio for cls in classes}
    # ZenFlow's and SuperOffload's own norm and unscale/clip ignore the ratio
    assert declared == {DeepSpeedOptimizer: False, ZeROOptimizer: True, FP16_Optimizer: True,
                        FP16_UnfusedOptimizer: False, BF16_Optimizer: False, ZenFlowZeroOptimizer: False,
                        SuperOffloadOptimizer_Stage3: False}, declared
    engine = PATHS[path_name].initialize(gas=1, managed=False)
    engine.optimizer.applies_gradient_divide_ratio = False  # as a ZeRO optimizer that ignored the ratio would
    engine.backward(forward_loss(engine, 0, 0), scale_wrt_gas=False)
    before = snapshot(engine).params
    with pytest.raises(ValueError, match="not supported with .*, which reduces the gradients itself") as error:
        engine.step(gradient_divide_factor=4.0)
    for name, p in snapshot(engine).params.items():
        assert torch.equal(before[name], p), f"{name} changed by a refused step"
    destroy(engine)
    return str(error.value)


@pytest.mark.base("0.19.3", reason="checks the 0.19.3 series' internals (its private methods and hooks)")
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("path_name", ["zero2-fp32", "zero3-fp32"])
def test_an_optimizer_that_does_not_apply_the_ratio_is_refused(dist, path_name):
    messages = dist.run(_divide_ratio_declarations_body, path_name)
    assert len(set(messages)) == 1, messages


def _logical_step_collectives(path_name: str, managed: bool, factor: float | None) -> dict:
    """Collectives (calls and bytes per op) of the second logical step of two backward passes: managed with
    gradient_accumulation_steps=2 (backward and step() per micro-batch, the second step() the boundary), or
    unmanaged (two backward passes, one step(), with or without a factor)."""
    from ds_bench.comm_counter import CommCounter
    from ds_harness.support.paths import PATHS
    from ds_harness.support.training import destroy, forward_loss

    # The count's option refuses gradient_accumulation_steps other than 1
    engine = PATHS[path_name].initialize(gas=1 if factor else 2, managed=managed,
                                         **(divisor_config() if factor else {}))
    for step in range(2):
        with CommCounter() as counter:
            for i in range(2):
                engine.backward(forward_loss(engine, step, i))
                if managed:
                    engine.step()
            if not managed:
                engine.step(**(divisor_step_kwargs(factor, 2) if factor else {}))
        counts = counter.snapshot()
    destroy(engine)
    return counts


@pytest.mark.base("0.19.8", reason="the 0.19.8 series' promise; the 0.19.3 series checks its own step")
@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name", ["zero2-fp32", "zero3-fp32", "zero2-offload", "zero3-offload"])
def test_unmanaged_step_without_a_factor_adds_no_collective_at_zero_2_and_3(dist, path_name):
    """At ZeRO stages 2 and 3 an unmanaged step() without a factor communicates exactly as a managed boundary
    step (no check of its own, so no host read of one either); with a factor it adds one all-reduce of three int64
    and their negations (whether any rank's factor is invalid, and its exact integer parts), with
    require_gradient_divide_count one all-reduce of three int64 (the counts' sum, and how many are negative or
    invalid)."""
    managed = dist.run(_logical_step_collectives, path_name, True, None)
    assert all(counts for counts in managed), "a ZeRO-2/3 step on 2 ranks communicates"
    assert dist.run(_logical_step_collectives, path_name, False, None) == managed
    for counts, expected in zip(dist.run(_logical_step_collectives, path_name, False, 4.0), managed):
        all_reduce = expected.get("all_reduce", {"calls": 0, "bytes": 0})
        expected = {**expected, "all_reduce": {"calls": all_reduce["calls"] + 1, "bytes": all_reduce["bytes"] + 24}}
        assert counts == expected
