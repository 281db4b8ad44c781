"""An unmanaged step() costs nothing that was not asked for: without a gradient_divide_factor, a logical step (N
backward passes and one step()) issues exactly the collectives of a managed boundary step with
gradient_accumulation_steps = N, call for call and byte for byte, and reads the device from the host exactly as often:
at ZeRO stages 2 and 3 on both series, at stages 0 and 1 on the 0.19.8 series (whose checks there are rank-local); a
factor adds exactly one small all-reduce and its one host read. On the 0.19.3 series, at stages 0 and 1, the step's
one all-reduce of per-rank checks carries the factor at no extra cost.

Collectives are counted by the benchmarks' counter (``ds_bench.comm_counter``, wrapping the communication backend
that every ``deepspeed.comm`` collective ends in); host reads by wrapping the tensor methods that copy a value to the
host (``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

ON_0_19_3 = pytest.mark.base("0.19.3", reason="the 0.19.3 series' step checks (their sizes and PRs)")
ON_0_19_8 = pytest.mark.base("0.19.8", reason="the 0.19.8 series' rank-local step checks")

N = 2
#: The factor check at ZeRO stages 2 and 3: (min, max) pairs of 3 int64 (the factor's state, mantissa, exponent).
FACTOR_CHECK_BYTES = 3 * 2 * 8
#: The 0.19.8 series' step(gradient_divide_count=...): one all-reduce of three int64 (the counts' sum, how many are
#: negative, how many are missing or invalid)
COUNT_CHECK_BYTES = 3 * 8
#: The step check at stages 0 and 1: (min, max) pairs of 5 int64 (backward count, no_sync(), the factor's three).
STEP_CHECK_BYTES = 5 * 2 * 8

_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


@contextmanager
def _counting_host_reads(counts: dict):
    import torch

    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def counting(name, method):

        def read(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return method(self, *args, **kwargs)

        return read

    for name, method in originals.items():
        setattr(torch.Tensor, name, counting(name, method))
    try:
        yield counts
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def _logical_step_costs(path_name: str, managed: bool, factor: float | None) -> dict:
    """Collectives and host reads of the second of two logical steps of N backward passes (the first sets up)."""
    from ds_bench.comm_counter import CommCounter
    from ds_harness.support.paths import PATHS
    from ds_harness.support.training import destroy, forward_loss

    from ds_harness.support.divisor import divisor_config, divisor_step_kwargs

    more = divisor_config() if factor is not None else {}
    engine = PATHS[path_name].initialize(gas=N if managed else 1, managed=managed, **more)
    costs = {}
    for step in range(2):
        reads: dict = {}
        with CommCounter() as counter, _counting_host_reads(reads):
            for i in range(N):
                loss = forward_loss(engine, step, i)
                if managed:
                    engine.backward(loss)
                    engine.step()
                else:
                    engine.backward(loss)
            if not managed:
                engine.step(**({} if factor is None else divisor_step_kwargs(factor, 2)))
            costs = {"collectives": counter.snapshot(), "host_reads": reads}
    assert engine.global_steps == 2
    destroy(engine)
    return costs


def step_costs_body(path_name: str, with_factor: bool = False) -> dict:
    costs = {
        "managed": _logical_step_costs(path_name, True, None),
        "unmanaged": _logical_step_costs(path_name, False, None),
    }
    if with_factor:  # step(gradient_divide_factor=...) exists from gradient-divide-factor on
        costs["factor"] = _logical_step_costs(path_name, False, 4.0)
    return costs


def _plus_one_all_reduce(counts: dict, nbytes: int) -> dict:
    out = {op: dict(entry) for op, entry in counts.items()}
    entry = out.setdefault("all_reduce", {"calls": 0, "bytes": 0})
    entry["calls"] += 1
    entry["bytes"] += nbytes
    return out


def _plus_one_read(reads: dict) -> dict:
    return {**reads, "tolist": reads.get("tolist", 0) + 1}


def _stage(pr: str, *names: str):
    return [pytest.param(name, marks=pytest.mark.pr(pr), id=name) for name in names]


@ON_0_19_3
@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name",
                         _stage("zero-2", "zero2-fp32", "zero2-overlap-comm") + _stage("zero-3", "zero3-fp32") +
                         _stage("zero-offload", "zero2-offload", "zero3-offload"))
def test_unmanaged_step_at_zero_2_3_adds_no_collective_and_no_host_read(dist, path_name):
    for costs in dist.run(step_costs_body, path_name):
        managed, unmanaged = costs["managed"], costs["unmanaged"]
        assert managed["collectives"], "a ZeRO-2/3 step on 2 ranks communicates"
        assert unmanaged["collectives"] == managed["collectives"]
        assert unmanaged["host_reads"] == managed["host_reads"]


@ON_0_19_3
@pytest.mark.pr("gradient-divide-factor")
@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name", ["zero2-fp32", "zero3-fp32", "zero2-offload", "zero3-offload"])
def test_a_factor_at_zero_2_3_adds_one_small_all_reduce_and_one_host_read(dist, path_name):
    for costs in dist.run(step_costs_body, path_name, True):
        managed, unmanaged, factor = costs["managed"], costs["unmanaged"], costs["factor"]
        assert unmanaged["collectives"] == managed["collectives"]
        assert factor["collectives"] == _plus_one_all_reduce(managed["collectives"], FACTOR_CHECK_BYTES)
        assert factor["host_reads"] == _plus_one_read(managed["host_reads"])


@ON_0_19_3
@pytest.mark.pr("gradient-divide-factor")
@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero1-fp32"])
def test_at_zero_0_1_the_factor_travels_in_the_step_check(dist, path_name):
    for costs in dist.run(step_costs_body, path_name, True):
        managed, unmanaged, factor = costs["managed"], costs["unmanaged"], costs["factor"]
        assert unmanaged["collectives"] == _plus_one_all_reduce(managed["collectives"], STEP_CHECK_BYTES)
        assert factor["collectives"] == unmanaged["collectives"]
        assert unmanaged["host_reads"] == factor["host_reads"] == _plus_one_read(managed["host_reads"])


#: Every way the unmanaged step reduces: the engine's all-reduce (fp32, the BF16 optimizer), ZeRO-1's reduce_gradients()
#: (fp32, offload), ZeRO-2/3's finalize (with and without offload).
PATHS_0_19_8 = ["fp32-deepspeed-optimizer", "bf16", "zero1-fp32", "zero1-bf16-fp32-accumulation", "zero1-offload",
                "zero2-fp32", "zero2-overlap-comm", "zero3-fp32", "zero2-offload", "zero3-offload"]


@ON_0_19_8
@pytest.mark.pr("unmanaged-step-checks")
@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name", PATHS_0_19_8)
def test_unmanaged_step_adds_no_collective_and_no_host_read(dist, path_name):
    for costs in dist.run(step_costs_body, path_name):
        managed, unmanaged = costs["managed"], costs["unmanaged"]
        assert managed["collectives"], "a step on 2 ranks communicates"
        assert unmanaged["collectives"] == managed["collectives"]
        assert unmanaged["host_reads"] == managed["host_reads"]


@ON_0_19_8
@pytest.mark.pr("gradient-divide-factor")
@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero1-fp32", "zero2-fp32", "zero3-fp32"])
def test_a_count_adds_one_small_all_reduce_and_one_host_read(dist, path_name):
    for costs in dist.run(step_costs_body, path_name, True):
        managed, unmanaged, factor = costs["managed"], costs["unmanaged"], costs["factor"]
        assert unmanaged["collectives"] == managed["collectives"]
        assert factor["collectives"] == _plus_one_all_reduce(managed["collectives"], COUNT_CHECK_BYTES)
        assert factor["host_reads"] == _plus_one_read(managed["host_reads"])
