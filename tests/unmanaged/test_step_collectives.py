"""An unmanaged step() costs nothing that was not asked for: without a gradient divisor, a logical step (N backward
passes and one step()) issues exactly the collectives of a managed boundary step with gradient_accumulation_steps =
N, call for call and byte for byte, and reads the device from the host exactly as often, at every ZeRO stage, on both
series (their checks are rank-local); a divisor (the 0.19.3 series' factor, the 0.19.8 series' count) adds exactly
one small all-reduce and its one host read.

Collectives are counted by the benchmarks' counter (``ds_bench.comm_counter``, wrapping the communication backend
that every ``deepspeed.comm`` collective ends in); host reads by wrapping the tensor methods that copy a value to the
host (``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

N = 2
#: The 0.19.3 series' step(gradient_divide_factor=...): (min, max) pairs of 3 int64 (the factor's state, mantissa,
#: exponent), among the ranks that pass one.
FACTOR_CHECK_BYTES = 3 * 2 * 8
#: The 0.19.8 series' step(gradient_divide_count=...): one all-reduce of three int64 (the counts' sum, how many are
#: negative, how many are missing or invalid)
COUNT_CHECK_BYTES = 3 * 8

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
    from ds_harness.support.divisor import divisor_config, divisor_step_kwargs
    from ds_harness.support.paths import PATHS
    from ds_harness.support.training import destroy, forward_loss

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


#: Every way the unmanaged step reduces: the engine's all-reduce (fp32, the BF16 optimizer), ZeRO-1's
#: reduce_gradients() (fp32, offload), ZeRO-2/3's finalize (with and without offload); and the 0.19.3 series' PR that
#: brings each.
PATHS = {
    "fp32-deepspeed-optimizer": "zero-0-1",
    "bf16": "zero-0-1",
    "zero1-fp32": "zero-0-1",
    "zero1-bf16-fp32-accumulation": "zero-0-1",
    "zero1-offload": "zero-offload",
    "zero2-fp32": "zero-2",
    "zero2-overlap-comm": "zero-2",
    "zero3-fp32": "zero-3",
    "zero2-offload": "zero-offload",
    "zero3-offload": "zero-offload",
}


def _paths(names) -> list:
    return [pytest.param(name, marks=pytest.mark.pr(PATHS[name], "unmanaged-step-checks"), id=name) for name in names]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name", _paths(PATHS))
def test_unmanaged_step_adds_no_collective_and_no_host_read(dist, path_name):
    for costs in dist.run(step_costs_body, path_name):
        managed, unmanaged = costs["managed"], costs["unmanaged"]
        assert managed["collectives"], "a step on 2 ranks communicates"
        assert unmanaged["collectives"] == managed["collectives"]
        assert unmanaged["host_reads"] == managed["host_reads"]


def _divisor_check_bytes() -> int:
    from ds_harness.support.divisor import divides_by_count

    return COUNT_CHECK_BYTES if divides_by_count() else FACTOR_CHECK_BYTES


@pytest.mark.pr("gradient-divide-factor")
@pytest.mark.world_size(2)
@pytest.mark.parametrize("path_name", ["fp32-deepspeed-optimizer", "zero1-fp32", "zero2-fp32", "zero3-fp32"])
def test_a_divisor_adds_one_small_all_reduce_and_one_host_read(dist, path_name):
    for costs in dist.run(step_costs_body, path_name, True):
        managed, unmanaged, divisor = costs["managed"], costs["unmanaged"], costs["factor"]
        assert unmanaged["collectives"] == managed["collectives"]
        assert divisor["collectives"] == _plus_one_all_reduce(managed["collectives"], _divisor_check_bytes())
        assert divisor["host_reads"] == _plus_one_read(managed["host_reads"])
