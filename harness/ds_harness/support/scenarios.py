"""Scenarios run on every rank by the per-PR tests: each takes a path name from ``ds_harness.support.paths.PATHS``.

A scenario asserts on the rank itself (a failure names the rank) and compares real parameters, optimizer
state and bookkeeping bitwise between engines fed the same data.
"""

import deepspeed
import deepspeed.comm as ds_comm
import pytest
import torch

from .divisor import divides_by_count, divisor_config, divisor_step_kwargs
from .paths import PATHS, make_branchy_model
from .training import (
    MICRO_BATCH,
    assert_identical,
    backward,
    destroy,
    forward_loss,
    run_boundary_driven,
    run_managed,
    run_unmanaged,
    snapshot,
)

STEPS = 3


def _summation_order_may_differ(path_name: str) -> bool:
    """Whether an unmanaged step may sum the ranks' gradients in another order than the managed one: at ZeRO-1 both
    series reduce zeros for a parameter no rank's backward reached (managed mode skips it), which moves the other
    gradients within the reduction buckets, and with more than two ranks the ring all-reduce's order of summation
    depends on a gradient's place in its bucket."""
    path = PATHS[path_name]
    return path.stage == 1 and ds_comm.get_world_size() > 2 and path.model_fn is make_branchy_model


def fixed_n_parity(path_name: str, n: int) -> None:
    path = PATHS[path_name]
    managed = path.initialize(gas=n, managed=True)
    run_managed(managed, [n] * STEPS)
    expected = snapshot(managed)
    destroy(managed)

    unmanaged = path.initialize(gas=n, managed=False)
    run_unmanaged(unmanaged, [n] * STEPS)
    assert unmanaged.global_steps == STEPS
    assert_identical(expected,
                     snapshot(unmanaged),
                     f"{path_name}, N={n}",
                     rounding=_summation_order_may_differ(path_name))
    destroy(unmanaged)


def variable_n_parity(path_name: str, plan: list) -> None:
    path = PATHS[path_name]
    managed = path.initialize(gas=1, managed=True)
    run_boundary_driven(managed, plan)
    expected = snapshot(managed)
    destroy(managed)

    unmanaged = path.initialize(gas=1, managed=False)
    run_unmanaged(unmanaged, plan, divide_by_n=True)
    # A boundary-driven managed engine counts train_batch_size per step whatever N was; unmanaged counts
    # the samples of every backward pass.
    actual = snapshot(unmanaged)
    assert actual.scalars["global_samples"] == MICRO_BATCH * ds_comm.get_world_size() * sum(plan)
    assert_identical(expected,
                     actual,
                     f"{path_name}, plan {plan}",
                     ignore={"global_samples"},
                     rounding=_summation_order_may_differ(path_name))
    destroy(unmanaged)


def boundary_only_during_step(path_name: str) -> None:
    path = PATHS[path_name]
    seen = []

    class RecordingScheduler(torch.optim.lr_scheduler.LambdaLR):

        def step(self, *args, **kwargs):
            seen.append(engine.is_gradient_accumulation_boundary())
            if getattr(self, "fail", False):
                raise RuntimeError("scheduler failure")
            return super().step(*args, **kwargs)

    engine = path.initialize(gas=2, managed=False, scheduler=None)
    engine.lr_scheduler = RecordingScheduler(engine.optimizer if not hasattr(engine.optimizer, "optimizer") else
                                             engine.optimizer.optimizer, lambda _: 1.0)
    seen.clear()  # LambdaLR steps once on construction
    assert not engine.is_gradient_accumulation_boundary()
    run_unmanaged(engine, [2, 1])  # asserts the boundary is false during and after every backward and step
    assert seen == [True, True]

    engine.lr_scheduler.fail = True
    backward(engine, forward_loss(engine, 5, 0))
    with pytest.raises(RuntimeError, match="scheduler failure"):
        engine.step()
    assert not engine.is_gradient_accumulation_boundary()
    if deepspeed.__version__.startswith("0.19.3"):
        # The 0.19.3 series resets the ZeRO optimizer's own flag too; 0.19.8 sets that one from the engine's at
        # every backward.
        assert not engine.optimizer.is_gradient_accumulation_boundary
    destroy(engine)


def bookkeeping(path_name: str, torch_style: bool) -> None:
    path = PATHS[path_name]
    engine = path.initialize(gas=2, managed=False, steps_per_print=1)
    reports = []
    engine._report_progress = lambda step: reports.append(step)
    plan = [1, 3, 2]
    run_unmanaged(engine, plan, torch_style=torch_style)
    assert engine.global_steps == len(plan)
    assert engine.global_samples == MICRO_BATCH * ds_comm.get_world_size() * sum(plan)
    assert engine.was_step_applied()
    assert engine.lr_scheduler.last_batch_iteration == len(plan) - 1  # WarmupLR steps once per update
    # steps_per_print keys on step(), not on micro-steps (rank 0 reports)
    assert reports == ([1, 2, 3] if ds_comm.get_rank() == 0 else [])
    assert engine.tput_timer.global_step_count == len(plan)
    destroy(engine)


def torch_style_backward_parity(path_name: str) -> None:
    path = PATHS[path_name]
    engine_api = path.initialize(gas=3, managed=False)
    run_unmanaged(engine_api, [3, 1, 2])
    expected = snapshot(engine_api)
    destroy(engine_api)
    torch_api = path.initialize(gas=3, managed=False)
    run_unmanaged(torch_api, [3, 1, 2], torch_style=True)
    assert_identical(expected, snapshot(torch_api), "engine.scale(loss).backward() vs engine.backward(loss)")
    destroy(torch_api)


def zero_grad_discards(path_name: str) -> None:
    path = PATHS[path_name]
    reference = path.initialize(gas=2, managed=False)
    run_unmanaged(reference, [2, 2])
    expected = snapshot(reference)
    destroy(reference)

    engine = path.initialize(gas=2, managed=False)
    run_unmanaged(engine, [2])
    for i in range(3):  # a partial accumulation on other data, then discarded
        backward(engine, forward_loss(engine, 99, i))
    engine.zero_grad()
    if engine.zero_optimization_stage() >= 2:
        with pytest.raises(RuntimeError, match="no backward"):
            engine.step()  # the discarded backward passes are not pending any more
    elif hasattr(engine, "pending_backward_count"):  # public from the gradient-divide PR of each series on
        # At ZeRO-0/1 a step() after no backward steps on zeros (a warning), so the count says it
        assert engine.pending_backward_count() == 0
    run_unmanaged(engine, [2], first_step=1)
    assert_identical(expected, snapshot(engine), f"{path_name}: zero_grad() must discard the partial accumulation")
    destroy(engine)


def zero_grad_discards_what_no_later_backward_overwrites(path_name: str) -> None:
    """engine.zero_grad() drops all a step has accumulated, also for the parameters that the backward passes after
    it do not reach (they would not overwrite it): the discarded backward passes use both heads of a two-head
    model and a gradient is set on head b with safe_set_full_grad(); the kept ones use head a only. Head b must
    step as in a run without the discarded part (zero gradient), not on the discarded gradient."""
    import dataclasses

    from deepspeed.utils import safe_set_full_grad

    from .paths import make_two_head_model

    path = dataclasses.replace(PATHS[path_name], model_fn=make_two_head_model)
    reference = path.initialize(gas=2, managed=False)
    reference.module.use = "a"
    run_unmanaged(reference, [2, 2])
    expected = snapshot(reference)
    destroy(reference)

    engine = path.initialize(gas=2, managed=False)
    engine.module.use = "a"
    run_unmanaged(engine, [2])
    engine.module.use = "ab"
    for i in range(2):  # a partial accumulation on other data, then discarded
        backward(engine, forward_loss(engine, 99, i))
    for p in engine.module.head_b.parameters():
        safe_set_full_grad(p, torch.full(p.ds_shape if hasattr(p, "ds_shape") else p.shape, 0.25))
    engine.zero_grad()
    engine.module.use = "a"
    run_unmanaged(engine, [2], first_step=1)
    assert_identical(expected, snapshot(engine), f"{path_name}: zero_grad() must discard head b's gradient too")
    destroy(engine)


def fp16_overflow_inside_accumulation(path_name: str) -> None:
    path = PATHS[path_name]

    def drive(engine, managed: bool) -> list:
        states = []
        for step in range(3):
            for i in range(3):
                loss = forward_loss(engine, step, i)
                if step == 1 and i == 1:
                    loss = loss * float("inf")  # one overflowing micro-batch inside the accumulation
                backward(engine, loss)
                if managed:
                    engine.step()
            if not managed:
                engine.step()
            states.append(snapshot(engine))
        return states

    # No LR warm-up here: its first LR is 0, which would hide whether the step after the skip trains.
    managed = path.initialize(gas=3, managed=True, scheduler=None)
    expected = drive(managed, True)
    destroy(managed)
    unmanaged = path.initialize(gas=3, managed=False, scheduler=None)
    actual = drive(unmanaged, False)
    destroy(unmanaged)

    for e, a in zip(expected, actual):
        assert_identical(e, a, f"{path_name} with an overflow at step 1")
    before, skipped, after = actual
    assert not skipped.scalars["was_step_applied"] and skipped.scalars["skipped_steps"] == 1
    assert skipped.scalars["loss_scale"] < before.scalars["loss_scale"]
    assert all(torch.equal(before.params[k], skipped.params[k]) for k in before.params), "skipped step changed params"
    assert after.scalars["was_step_applied"]
    assert any(not torch.equal(skipped.params[k], after.params[k]) for k in after.params), "next step did not train"


def checkpoint_round_trip(path_name: str, save_dir: str) -> None:
    path = PATHS[path_name]
    plan = [2, 3, 1, 2]
    uninterrupted = path.initialize(gas=2, managed=False)
    run_unmanaged(uninterrupted, plan)
    expected = snapshot(uninterrupted)
    destroy(uninterrupted)

    first = path.initialize(gas=2, managed=False)
    run_unmanaged(first, plan[:2])
    backward(first, forward_loss(first, 2, 0))
    with pytest.raises(RuntimeError, match=r"1 backward pass\(es\)"):
        first.save_checkpoint(save_dir, tag="pending")
    first.zero_grad()
    first.save_checkpoint(save_dir, tag="resume")
    destroy(first)

    resumed = path.initialize(gas=2, managed=False)
    resumed.load_checkpoint(save_dir, tag="resume")
    run_unmanaged(resumed, plan[2:], first_step=2)
    assert_identical(expected, snapshot(resumed), f"{path_name}: load_checkpoint() then training on")
    destroy(resumed)


def full_batch_reference(path_name: str, plan: list) -> None:
    """Unmanaged variable-N training against single-process, full-batch plain PyTorch.

    The reference builds the same model, sees every rank's micro-batches of a step as one batch and
    minimises the mean loss with torch.optim.AdamW; DeepSpeed gets each micro-batch loss divided by N
    (``scale_wrt_gas=False``) and averages over ranks, which is the same mean. Only the order of the fp32
    summations differs (per micro-batch, then across ranks, versus one batch), so gradients agree to a
    few ulps; Adam's normalised update keeps the parameter error near lr * 1e-6, hence rtol 1e-5 and
    atol 1e-6 after a handful of steps.
    """
    from .training import loss_fn, make_model, micro_batch

    path = PATHS[path_name]
    assert path.model_fn is make_model and path.dtype == "fp32", "the reference is plain fp32 TinyMLP"
    engine = path.initialize(gas=1, managed=False, gradient_clipping=0.0, scheduler=None)
    run_unmanaged(engine, plan, divide_by_n=True)
    actual = snapshot(engine)
    destroy(engine)

    world_size = ds_comm.get_world_size()
    reference = make_model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for step, n in enumerate(plan):
        batches = [micro_batch(step, i, rank) for rank in range(world_size) for i in range(n)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        loss_fn(reference(x), y).backward()
        optimizer.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(actual.params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _live_cpu_tensor_bytes() -> int:
    import gc

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # Plain tensors and parameters only: fake/functional tensors other code left behind have no data.
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def gradient_bytes_held_across_backwards(path_name: str, managed: bool, n: int) -> list:
    """Bytes of tensor storage an accumulation holds after each backward of a logical step, measured.

    Not assumed from the optimizer's data structures: the garbage collector enumerates every live tensor
    and the distinct storages behind them are summed, so a gradient buffer kept across backward passes
    shows up whatever holds it. The baseline is taken after a warm-up step (optimizer states, buckets
    and buffers exist), which also cancels whatever earlier engines on this rank left behind.
    """
    engine = PATHS[path_name].initialize(gas=n, managed=managed)
    (run_managed if managed else run_unmanaged)(engine, [n])
    baseline = _live_cpu_tensor_bytes()
    held = []
    for i in range(n):
        backward(engine, forward_loss(engine, 1, i))
        held.append(_live_cpu_tensor_bytes() - baseline)
        if managed and i < n - 1:
            engine.step()
    destroy(engine)
    return held


def sixteen_bit_export_parity(path_name: str, save_dir: str) -> None:
    """engine.save_16bit_model() after unmanaged steps writes what it writes after managed steps."""
    import os

    states = []
    for managed in (True, False):
        engine = PATHS[path_name].initialize(gas=2, managed=managed,
                                             zero_optimization={"stage3_gather_16bit_weights_on_model_save": True})
        (run_managed if managed else run_unmanaged)(engine, [2, 2])
        folder = os.path.join(save_dir, "managed" if managed else "unmanaged")
        assert engine.save_16bit_model(folder)
        destroy(engine)
        ds_comm.barrier()
        if ds_comm.get_rank() == 0:
            states.append(torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True))
    if ds_comm.get_rank() == 0:
        from .training import bitwise_equal

        assert states[0].keys() == states[1].keys()
        assert all(bitwise_equal(states[0][k], states[1][k]) for k in states[0]), "16-bit exports differ"


# ----------------------------------------------------------------------------------------------
# gradient-divide-factor: step(gradient_divide_factor=...)
# ----------------------------------------------------------------------------------------------


def _token_mask(step: int, index: int, rank: int) -> torch.Tensor:
    """Which output elements ("tokens") of a micro-batch count; a different number per micro-batch."""
    from .training import MICRO_BATCH, OUTPUTS

    g = torch.Generator().manual_seed(7_000_003 * step + 7919 * index + rank)
    mask = (torch.rand(MICRO_BATCH, OUTPUTS, generator=g) < 0.6).float()
    mask[0, 0] = 1.0
    return mask


def _token_sum_loss(engine, step: int, index: int) -> tuple:
    """Raw sum of per-token squared errors over the micro-batch's tokens, and the token count."""
    import deepspeed.comm as dist

    from .training import micro_batch, model_dtype

    x, y = micro_batch(step, index, dtype=model_dtype(engine))
    mask = _token_mask(step, index, dist.get_rank()).to(engine.device)
    from . import training
    training._CURRENT = (step, index)
    out = engine(x.to(engine.device)).float()
    return ((out - y.to(engine.device).float()).pow(2) * mask).sum(), mask.sum()


def _global_tokens(plan_step_n: int, step: int) -> float:
    world = ds_comm.get_world_size()
    return float(sum(_token_mask(step, i, r).sum() for r in range(world) for i in range(plan_step_n)))


def _run_token_mean(path_name: str, plan: list, predivide: bool, as_tensor: bool = False, **more) -> object:
    engine = PATHS[path_name].initialize(gas=1, managed=False, scheduler=None, **divisor_config(), **more)
    rank = ds_comm.get_rank()
    norms = []
    for step, n in enumerate(plan):
        tokens = _global_tokens(n, step)
        local_tokens = 0
        for i in range(n):
            loss, count = _token_sum_loss(engine, step, i)
            local_tokens += int(count.item())
            engine.backward(loss / tokens if predivide else loss, scale_wrt_gas=False)
        assert engine.pending_backward_count() == n
        # Pre-divided losses: a divisor of 1 (with per-rank counts, rank 0's 1 and zeros)
        factor, local = (1.0, int(rank == 0)) if predivide else (tokens, local_tokens)
        engine.step(**divisor_step_kwargs(torch.tensor(factor) if as_tensor else factor,
                                          torch.tensor(local) if as_tensor else local))
        assert engine.pending_backward_count() == 0
        norms.append(engine.get_global_grad_norm())
    result = snapshot(engine)
    result.scalars["norms"] = norms
    destroy(engine)
    return result


def _tolerance(path_name: str) -> dict:
    """fp32: a few ulps through Adam (see above). bf16/fp16 training computes gradients from differently
    scaled losses that round differently in backward, and the (fp32 master or low-precision) parameters
    drift apart by a few ulps of the training dtype after a few Adam steps: allow two units in the last
    place of the training dtype at magnitude 1."""
    dtype = PATHS[path_name].dtype
    if dtype == "fp32":
        return dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=0, atol=2 * torch.finfo(torch.bfloat16 if dtype == "bf16" else torch.float16).eps)


def token_mean_matches_full_batch_and_predivided(path_name: str, plan: list) -> None:
    """(a) Sums of raw per-token losses over a variable N, normalised by the global token count at step(),
    match a single-process full-batch token-mean reference and the same run with pre-divided losses.

    Tolerances: the three computations sum the same fp32 terms in different orders (per micro-batch,
    across ranks, then one multiplication; versus one batch) and Adam normalises the update, so the
    parameters agree to ~lr * 1e-6 after a handful of steps: rtol 1e-5, atol 1e-6.
    """
    from .training import make_model, micro_batch

    raw = _run_token_mean(path_name, plan, predivide=False, gradient_clipping=0.0)
    predivided = _run_token_mean(path_name, plan, predivide=True, as_tensor=True, gradient_clipping=0.0)
    for name in raw.params:
        torch.testing.assert_close(raw.params[name].float(), predivided.params[name].float(), **_tolerance(path_name))
    # (c) the norm (and so clipping) sees the normalised gradient; DeepSpeed records no norm without a
    # DeepSpeed optimizer wrapper (plain fp32 without ZeRO), in either mode
    if raw.scalars["norms"][0] is not None:
        low_precision = PATHS[path_name].dtype != "fp32"
        rtol = 2 * torch.finfo(torch.bfloat16 if PATHS[path_name].dtype == "bf16" else torch.float16).eps \
            if low_precision else 1e-5
        torch.testing.assert_close(torch.tensor(raw.scalars["norms"]), torch.tensor(predivided.scalars["norms"]),
                                   rtol=rtol, atol=0)
    # The reference trains the test model in fp32 with AdamW, as the DeepSpeed optimizer paths do.
    path = PATHS[path_name]
    if path.dtype != "fp32" or path.model_fn is not make_model or path.kwargs().get("optimizer"):
        return
    world = ds_comm.get_world_size()
    reference = make_model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for step, n in enumerate(plan):
        optimizer.zero_grad()
        total, tokens = 0.0, 0.0
        for r in range(world):
            for i in range(n):
                x, y = micro_batch(step, i, r)
                mask = _token_mask(step, i, r)
                total = total + ((reference(x) - y).pow(2) * mask).sum()
                tokens += float(mask.sum())
        (total / tokens).backward()
        optimizer.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(raw.params[name], p.detach(), rtol=1e-5, atol=1e-6)


def micro_batch_mean_recipe_equals_managed(path_name: str, n: int) -> None:
    """(b) Raw losses, then step(gradient_divide_factor=pending_backward_count() * dp_world_size) is the
    mean over all micro-batches: managed mode with gradient_accumulation_steps=N. Managed divides every
    gradient by N during backward, the factor divides the reduced sum once: when N and the world size are
    powers of two both are exact scalings, so the results are bitwise equal; otherwise equal up to
    rounding."""
    exact = n & (n - 1) == 0 and ds_comm.get_world_size() & (ds_comm.get_world_size() - 1) == 0
    managed = PATHS[path_name].initialize(gas=n, managed=True, scheduler=None)
    run_managed(managed, [n] * STEPS)
    expected = snapshot(managed)
    destroy(managed)
    # The count's option refuses gradient_accumulation_steps other than 1 (backward() would also divide by it)
    engine = PATHS[path_name].initialize(gas=1 if divides_by_count() else n,
                                         managed=False,
                                         scheduler=None,
                                         **divisor_config())
    for step in range(STEPS):
        for i in range(n):
            engine.backward(forward_loss(engine, step, i), scale_wrt_gas=False)
        pending = engine.pending_backward_count()
        engine.step(**divisor_step_kwargs(pending * engine.dp_world_size, pending))
    actual = snapshot(engine)
    destroy(engine)
    if exact:
        assert_identical(expected, actual, "factor N * world vs managed gradient_accumulation_steps=N")
        return
    for name in expected.params:
        torch.testing.assert_close(actual.params[name].float(), expected.params[name].float(), rtol=1e-5, atol=1e-6)
    if expected.scalars["grad_norm"] is not None:
        torch.testing.assert_close(actual.scalars["grad_norm"], expected.scalars["grad_norm"], rtol=1e-5, atol=0)


def factor_lasts_one_step(path_name: str) -> None:
    """(d) The factor applies to its step only: after a step with a factor, a step without one averages over the
    data-parallel ranks, exactly as a step with the factor dp_world_size does (the same division), in the
    parameters, the optimizer state and the gradient norm."""
    runs = []
    for later_factor in (None, "dp_world_size"):
        engine = PATHS[path_name].initialize(gas=1, managed=False, scheduler=None, gradient_clipping=0.0)
        norms = []
        for step in range(3):
            for i in range(2):
                engine.backward(forward_loss(engine, step, i), scale_wrt_gas=False)
            if step == 0:
                engine.step(gradient_divide_factor=7.0)
            elif later_factor is None:
                engine.step()
            else:
                engine.step(gradient_divide_factor=float(engine.dp_world_size))
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
        result = snapshot(engine)
        result.scalars["norms"] = norms
        runs.append(result)
        destroy(engine)
    assert_identical(runs[1], runs[0], f"{path_name}: a step without a factor after one with gradient_divide_factor=7")


def clipping_sees_the_normalised_gradient(path_name: str) -> None:
    """(c) With clipping on, raw losses + factor equal pre-divided losses + factor 1."""
    plan = [2, 3]
    raw = _run_token_mean(path_name, plan, predivide=False, gradient_clipping=0.01)
    predivided = _run_token_mean(path_name, plan, predivide=True, gradient_clipping=0.01)
    for name in raw.params:
        torch.testing.assert_close(raw.params[name].float(), predivided.params[name].float(), **_tolerance(path_name))
    assert all(norm is not None and norm > 0.01 for norm in raw.scalars["norms"]), "the test must actually clip"


def factor_differing_across_ranks_raises_everywhere(path_name: str) -> str:
    engine = PATHS[path_name].initialize(gas=1, managed=False)
    engine.backward(forward_loss(engine, 0, 0))
    with pytest.raises(ValueError, match="(identical|the same) on every data-parallel rank") as error:
        engine.step(gradient_divide_factor=10.0 + ds_comm.get_rank())
    destroy(engine)
    return str(error.value)


def factor_errors(path_name: str) -> None:
    engine = PATHS[path_name].initialize(gas=1, managed=False)
    engine.backward(forward_loss(engine, 0, 0))
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive and finite"):
            engine.step(gradient_divide_factor=bad)
    with pytest.raises(ValueError, match="a number or a (0-dim|one-element) tensor"):
        engine.step(gradient_divide_factor=torch.tensor([2.0, 2.0]))
    destroy(engine)
    managed = PATHS[path_name].initialize(gas=1, managed=True)
    managed.backward(forward_loss(managed, 0, 0))
    with pytest.raises(ValueError, match="requires managed_gradient_accumulation=false"):
        managed.step(gradient_divide_factor=4.0)
    destroy(managed)
    # Without an optimizer that unscales, the factor replaces the averaging of the all-reduce: refused when
    # the engine does not reduce (or does not average) the gradients.
    plain = PATHS["fp32-deepspeed-optimizer"].initialize(gas=1, managed=False)
    plain.enable_backward_allreduce = False
    plain.backward(forward_loss(plain, 0, 0))
    with pytest.raises(ValueError, match="enable_backward_allreduce=False"):
        plain.step(gradient_divide_factor=4.0)
    plain.enable_backward_allreduce, plain.gradient_average = True, False
    with pytest.raises(ValueError, match="gradient_average=False|gradient_allreduce_op='sum'"):
        plain.step(gradient_divide_factor=4.0)
    destroy(plain)
    moe = PATHS["moe"].initialize(gas=1, managed=False)
    moe.backward(forward_loss(moe, 0, 0))
    with pytest.raises(ValueError, match="not supported with MoE layers"):
        moe.step(gradient_divide_factor=4.0)
    destroy(moe)


def factor_type_errors(path_name: str) -> list:
    """A bool (which Python and torch read as 1) and a 1-element tensor that is not 0-dim are refused as factors, as
    any other shape is, before any collective."""
    engine = PATHS[path_name].initialize(gas=1, managed=False)
    engine.backward(forward_loss(engine, 0, 0))
    messages = []
    for bad in (True, torch.tensor(True), torch.tensor([2.0]), torch.tensor([[2.0]])):
        with pytest.raises(ValueError, match="a number or a 0-dim tensor") as error:
            engine.step(gradient_divide_factor=bad)
        messages.append(str(error.value))
    engine.step(gradient_divide_factor=torch.tensor(2.0))  # refused before any state changed
    destroy(engine)
    return messages


def gas_scaling_mismatch_warnings(path_name: str) -> list:
    """(e) Count the warnings for: N == GAS, N != GAS (twice), scale_wrt_gas=False, with a factor, and
    scale_wrt_gas=False after zero_grad() discarded a GAS-scaled backward (whose losses the step does not apply)."""
    from deepspeed.utils import logger

    seen = []
    original = logger.warning
    logger.warning = lambda msg, *a, **k: seen.append(str(msg))
    try:
        counts = []
        engine = PATHS[path_name].initialize(gas=2, managed=False)

        def step(n, **kwargs):
            before = len([m for m in seen if "gradient_accumulation_steps=2" in m])
            scale = kwargs.pop("scale_wrt_gas", True)
            for i in range(n):
                engine.backward(forward_loss(engine, 0, i), scale_wrt_gas=scale)
            engine.step(**kwargs)
            counts.append(len([m for m in seen if "gradient_accumulation_steps=2" in m]) - before)

        step(2)  # matches the configured GAS
        step(3, scale_wrt_gas=False)  # nothing was divided
        step(3, scale_wrt_gas=False, gradient_divide_factor=3.0)
        engine.backward(forward_loss(engine, 0, 0))  # GAS-scaled, then discarded
        engine.zero_grad()
        step(3, scale_wrt_gas=False)  # nothing the step applies was divided
        step(3)  # the classic mis-scaling: warns
        step(1)  # again, but only once per engine
        destroy(engine)
        return counts
    finally:
        logger.warning = original


def _wrong_factors(kind: str, stage: int) -> list:
    """(factor, message pattern) pairs one rank passes while its peers pass 4.0; built on the rank (a meta tensor
    does not travel). A factor missing on one rank is not among them: a step() without a factor makes no collective
    of its own at any stage, exactly as a managed boundary step, so nothing could detect it."""
    del stage
    if kind == "unreadable":  # a 0-dim factor that is no real number: .item() raises, or float() does
        return [(torch.tensor(2.0, device="meta"), "gradient_divide_factor"),
                (torch.tensor(2.0 + 0j), "gradient_divide_factor")]
    return [(torch.tensor([2.0, 2.0]), "gradient_divide_factor"), (-1.0, "gradient_divide_factor")]


def factor_errors_on_one_rank(path_name: str, kind: str = "invalid") -> list:
    """A factor that only one rank gets wrong (bad shape, not positive, missing; or, with ``kind="unreadable"``,
    a 0-dim tensor whose value is no real number): every rank raises, none hangs in a collective its peers never
    join, and the engine is still usable."""
    engine = PATHS[path_name].initialize(gas=1, managed=False)
    rank = ds_comm.get_rank()
    messages = []
    for bad, match in _wrong_factors(kind, PATHS[path_name].stage):
        engine.backward(forward_loss(engine, 0, 0))
        with pytest.raises(ValueError, match=match) as error:
            engine.step(gradient_divide_factor=bad if rank == 0 else 4.0)
        messages.append(str(error.value))
        engine.zero_grad()
    engine.backward(forward_loss(engine, 0, 0))
    engine.step(gradient_divide_factor=4.0)
    destroy(engine)
    return messages
