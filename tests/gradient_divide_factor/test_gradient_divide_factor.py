"""PR 5: step(gradient_divide_factor=...) normalises the summed gradient once per step, on every stage."""

import pytest

from support import scenarios

pytestmark = pytest.mark.pr(5)

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


@pytest.mark.world_size(2, 4)
@pytest.mark.parametrize("path_name", ["zero1-fp32", "zero3-fp32"])
def test_a_factor_differing_across_ranks_raises_on_every_rank(dist, path_name):
    messages = dist.run(scenarios.factor_differing_across_ranks_raises_everywhere, path_name)
    assert len(set(messages)) == 1, messages


@pytest.mark.world_size(1)
def test_invalid_factors_and_managed_mode_are_errors(dist):
    dist.run(scenarios.factor_errors, "zero1-fp32")


@pytest.mark.world_size(1, 2)
def test_gas_scaling_mismatch_warns_once_exactly_when_it_should(dist):
    assert dist.run(scenarios.gas_scaling_mismatch_warnings, "zero1-fp32")[0] == [0, 0, 0, 1, 0]
