"""The benchmark's collective counter counts exactly, on 1 and 2 ranks (no timing is asserted).

* Direct calls through ``deepspeed.comm``, however the op was imported: exact calls and bytes per op;
  paused calls are not counted; uninstalling restores the backend.
* The benchmark's own trial (:func:`ds_bench.trial.run_trial`) on a tiny ZeRO-0 model, N = 2:
  each logical step is exactly one all_reduce of all gradients (4 bytes per fp32 parameter, one
  bucket) plus one all_reduce of the 4-byte gradient norm (gradient clipping), and in unmanaged mode
  one small all_reduce of the step's per-rank checks; the non-boundary micro-step sends nothing.
* ZeRO 1, 2 and 3: the counter agrees call for call with DeepSpeed's own comms logger.
"""

from __future__ import annotations

import pytest

# The ranks import the installed `ds_bench` package.

pytestmark = [
    pytest.mark.pr("zero-0-1"),
    pytest.mark.base("0.19.3", reason="the benchmarks and their collective counter are built and checked on the "
                     "0.19.3 series"),
]


# -- bodies run on every rank ------------------------------------------------------------------------------
def direct_calls_body():
    import deepspeed.comm.comm as ds_comm
    import torch
    from deepspeed import comm as dist
    from deepspeed.comm import all_to_all_single  # imported by name, as ZeRO's coalesced collectives do

    from ds_bench.comm_counter import CommCounter

    world = dist.get_world_size()
    with CommCounter() as counter:
        dist.all_reduce(torch.ones(10))
        dist.all_reduce(torch.ones(6, dtype=torch.float64))
        dist.broadcast(torch.zeros(3, dtype=torch.int64), src=0)
        dist.allgather_fn(torch.empty(4 * world), torch.ones(4))
        dist.reduce_scatter_fn(torch.empty(2), torch.ones(2 * world))
        all_to_all_single(torch.empty(2 * world), torch.ones(2 * world))
        dist.barrier()
        with counter.paused():
            dist.barrier()
            dist.all_reduce(torch.ones(1000))
        counted = counter.snapshot()
    dist.all_reduce(torch.ones(1))
    after = counter.snapshot()
    restored = not any(name in vars(ds_comm.cdb) for name in ("all_reduce", "broadcast", "barrier"))
    return {"world": world, "counted": counted, "after": after, "restored": restored}


def trial_body(mode: str):
    from ds_bench.model import TINY
    from ds_bench.trial import run_trial_safely

    spec = {
        "device": "cpu",
        "backend": "gloo",
        "timeout_s": 120,
        "size": TINY.as_dict(),
        "configuration": "z0",
        "mode": mode,
        "n_micro": 2,
        "dtype": "fp32",
        "seed": 1234,
        "warmup_steps": 1,
        "measure_steps": 2,
        "threads": 1,
    }
    return run_trial_safely(spec)


def comms_logger_body(stage: int):
    import deepspeed
    from deepspeed import comm as dist

    from ds_bench import configs
    from ds_bench.comm_counter import CommCounter
    from ds_bench.model import TINY, build_model, micro_batches

    configuration = next(c for c in configs.CONFIGURATIONS if c.stage == stage and c.offload == "none")
    config = configs.ds_config(configuration,
                               configs.MANAGED,
                               2,
                               TINY.micro_batch,
                               dist.get_world_size(),
                               bucket_elements=1000)
    config["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False}
    model = build_model(TINY)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    batches = micro_batches(TINY, dist.get_rank(), 2, 2)
    try:
        configs.logical_step(configs.MANAGED, engine, batches[0], 2)  # warm-up: the first step may set things up
        dist.barrier()
        dist.comms_logger.comms_dict.clear()
        with CommCounter() as counter:
            configs.logical_step(configs.MANAGED, engine, batches[1], 2)
            ours = counter.snapshot()
        logged = {}
        for name, by_size in dist.comms_logger.comms_dict.items():
            logged[name] = sum(record[0] for record in by_size.values())
    finally:
        dist.configure(enabled=False, prof_all=False)
        dist.comms_logger.comms_dict.clear()
    return {"ours": ours, "logged": logged}


# -- tests ------------------------------------------------------------------------------------------------
@pytest.mark.world_size(1, 2)
def test_direct_calls_are_counted_exactly(dist):
    for result in dist.run(direct_calls_body):
        w = result["world"]
        assert w == dist.world_size
        assert result["counted"] == {
            "all_reduce": {
                "calls": 2,
                "bytes": 10 * 4 + 6 * 8
            },
            "broadcast": {
                "calls": 1,
                "bytes": 3 * 8
            },
            "all_gather_into_tensor": {
                "calls": 1,
                "bytes": 4 * w * 4
            },  # the gathered output
            "reduce_scatter_tensor": {
                "calls": 1,
                "bytes": 2 * w * 4
            },  # the full input
            "all_to_all_single": {
                "calls": 1,
                "bytes": 2 * w * 4
            },
            "barrier": {
                "calls": 1,
                "bytes": 0
            },
        }
        assert result["after"] == result["counted"], "a collective after uninstall() was counted"
        assert result["restored"]


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("mode", ["managed", "toggle", "unmanaged"])
def test_zero0_trial_counts_one_gradient_allreduce_per_step(dist, mode):
    results = dist.run(trial_body, mode)
    for result in results:
        assert result["status"] == "ok", result.get("traceback") or result
        params = result["parameters"]
        # In every mode, unmanaged too: an unmanaged step() adds no collective of its own
        expected = {"all_reduce": {"calls": 2, "bytes": 4 * params + 4}}
        assert result["counts"] == [expected, expected]
        assert result["warmup_counts"] == [expected]
        assert result["global_steps"] == 3  # one optimizer update per logical step


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_counter_agrees_with_deepspeed_comms_logger(dist, stage):
    aliases = {"inference_all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce"}
    for result in dist.run(comms_logger_body, stage):
        ours = {}
        for op, entry in result["ours"].items():
            ours[aliases.get(op, op)] = ours.get(aliases.get(op, op), 0) + entry["calls"]
        assert ours, "a ZeRO step with 2 ranks must communicate"
        assert ours == result["logged"]


def test_report_allows_unmanaged_mode_only_the_step_check():
    """The benchmark's collectives target: (b) may add step()'s one all-reduce of at most 80 bytes, nothing else."""
    from ds_bench import report

    managed = {"all_reduce": {"calls": 2, "bytes": 1000}, "all_gather": {"calls": 4, "bytes": 800}}

    def plus(calls, extra_bytes, **more):
        counts = {op: dict(entry) for op, entry in managed.items()}
        counts["all_reduce"] = {"calls": 2 + calls, "bytes": 1000 + extra_bytes}
        counts.update(more)
        return counts

    assert report.is_step_check(managed, plus(1, 80))
    assert report.is_step_check(managed, plus(1, 16))
    assert not report.is_step_check(managed, managed)
    assert not report.is_step_check(managed, plus(1, 81))
    assert not report.is_step_check(managed, plus(2, 80))
    assert not report.is_step_check(managed, plus(1, 80, all_gather={"calls": 5, "bytes": 800}))
    assert report.is_step_check({}, {"all_reduce": {"calls": 1, "bytes": 80}})


def test_payload_positions_match_the_backends_signatures() -> None:
    """Where a decorator hides a backend method's signature (0.19.8's ``stage_on_cpu``), the counter finds the payload
    by position: each position must be the payload's place in the method's own signature."""
    import inspect

    from deepspeed.comm.torch import TorchBackend

    from ds_bench.comm_counter import PAYLOAD_ARGUMENT, PAYLOAD_POSITION

    checked = 0
    for name, payload in PAYLOAD_ARGUMENT.items():
        method = getattr(TorchBackend, name, None)
        if payload is None or method is None:
            continue
        # The undecorated function: functools.wraps keeps it as __wrapped__; stage_on_cpu keeps it in its closure
        functions = [inspect.unwrap(method)] + [c.cell_contents for c in (method.__closure__ or ())
                                                if inspect.isfunction(c.cell_contents)]
        for function in functions:
            parameters = list(inspect.signature(function).parameters)[1:]
            if payload in parameters:
                assert parameters.index(payload) == PAYLOAD_POSITION.get(name, 0), name
                checked += 1
                break
    assert checked >= 10


def test_a_payload_hidden_by_a_decorator_is_found_by_position() -> None:
    import inspect

    import torch

    from ds_bench.comm_counter import _payload

    def hidden(*args, **kwargs):
        pass

    output, tensor = torch.zeros(4), torch.zeros(8)
    signature = inspect.signature(hidden)
    assert _payload(signature, "reduce_scatter_tensor", "input_tensor", (output, tensor), {}) is tensor
    assert _payload(signature, "all_reduce", "tensor", (tensor, ), {}) is tensor
    assert _payload(signature, "all_reduce", "tensor", (), {"tensor": tensor}) is tensor
