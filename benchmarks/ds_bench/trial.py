"""Trials on one rank. A trial is a fresh process (forked by :mod:`ds_bench.worker`) with its own
process group; the caller gives a JSON-able spec and gets a JSON-able result whose ``status`` is
``ok``, ``unsupported`` (the installed DeepSpeed has no unmanaged mode for this configuration) or
``error``. There are two kinds:

* ``mode`` (:func:`run_mode_trial`): one engine, one mode. It counts the collectives of every
  logical step and measures the peak memory of the measured steps, which therefore belong to that
  mode alone (with the allocator set so that RSS tracks live memory: see
  :func:`ds_bench.memory.stabilize_allocator`). With ``timed_methods`` in the spec it also times those
  methods per step (:mod:`ds_bench.method_timer`).
* ``timing`` (:func:`run_timing_trial`): one engine per mode in the same processes, driven step by
  step in rotating order (a, b, c, a′; then b, c, a′, a; ...), so each ratio compares neighbouring
  steps run under the same load. a′ is a second managed engine: a′/a is the ratio that measurement
  noise alone produces.
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from datetime import timedelta

from ds_bench import configs
from ds_bench.comm_counter import CommCounter, subtract
from ds_bench.memory import PeakMemory, current_rss_bytes, stabilize_allocator
from ds_bench.method_timer import MethodTimer
from ds_bench.model import ModelSize, build_model, micro_batches, parameter_count

#: The control engine of a timing trial: the mode named by the spec's ``control_of`` (default: managed) again.
CONTROL = "managed_control"


class Unsupported(Exception):
    """The installed DeepSpeed refuses unmanaged mode for this configuration."""


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".strip().splitlines()[0][:300]


def _mentions_flag(error: BaseException) -> bool:
    return configs.FLAG in f"{type(error).__name__}: {error}"


class Rank:
    """This rank's process group, model size and data for one trial."""

    def __init__(self, spec: dict):
        import deepspeed
        import torch
        from deepspeed import comm as dist

        self.spec = spec
        self.device = spec["device"]
        torch.set_num_threads(spec.get("threads", 1))
        if self.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        deepspeed.init_distributed(dist_backend=spec["backend"],
                                   timeout=timedelta(seconds=spec["timeout_s"]),
                                   verbose=False)
        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.size = ModelSize(**spec["size"])
        self.n_micro = spec["n_micro"]
        self.configuration = configs.BY_NAME[spec["configuration"]]

    @property
    def control_of(self) -> str:
        return self.spec.get("control_of", configs.MANAGED)

    def build_engine(self, mode: str, nvme_path=None):
        """A fresh model and engine for ``mode``; raises :class:`Unsupported` where the stack refuses it."""
        import inspect

        import deepspeed
        if mode == configs.FACTOR and "gradient_divide_factor" not in inspect.signature(
                deepspeed.DeepSpeedEngine.step).parameters:
            raise Unsupported(
                f"the installed DeepSpeed {deepspeed.__version__} has no step(gradient_divide_factor=...)")
        ds_config = configs.ds_config(self.configuration,
                                      self.control_of if mode == CONTROL else mode,
                                      self.n_micro,
                                      self.size.micro_batch,
                                      self.world,
                                      dtype=self.spec["dtype"],
                                      nvme_path=nvme_path)
        model = build_model(self.size, seed=self.spec["seed"])
        try:
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        except Exception as error:  # noqa: BLE001 - any refusal that names the flag means "not supported"
            if mode == configs.UNMANAGED and _mentions_flag(error):
                raise Unsupported(_first_line(error)) from error
            raise
        if mode in (configs.UNMANAGED, configs.FACTOR):
            flag = getattr(engine, configs.FLAG, None)
            if callable(flag):
                flag = flag()
            if flag is None:
                raise Unsupported(f"the installed DeepSpeed {deepspeed.__version__} has no engine.{configs.FLAG}")
            if flag is not False:
                raise Unsupported(f"engine.{configs.FLAG} is {flag!r} although the config sets false")
        return engine, parameter_count(model)

    def batches(self, steps: int, device):
        rows = micro_batches(self.size, self.rank, steps, self.n_micro, seed=self.spec["seed"])
        return [[b.to(device) for b in row] for row in rows]

    def synchronize(self) -> None:
        if self.device == "cuda":
            import torch
            torch.cuda.synchronize()

    def timed_step(self, mode, engine, row):
        """One logical step in ``mode``, timed from an aligned start: (mean loss, wall s, CPU s of this process)."""
        self.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = configs.logical_step(mode, engine, row, self.n_micro)
        self.synchronize()
        return float(loss) / self.n_micro, time.perf_counter() - start, time.process_time() - start_cpu


def run_mode_trial(spec: dict) -> dict:
    """One engine in ``spec["mode"]``: counts per step, peak memory, losses, times."""
    allocator_fixed = stabilize_allocator()
    rank = Rank(spec)
    dist = rank.dist
    gc.collect()
    baseline_rss = current_rss_bytes()  # before the model and engine exist
    counter = CommCounter().install()
    methods = MethodTimer(spec.get("timed_methods") or ()).install()
    mode = spec["mode"]
    engine, n_params = rank.build_engine(mode, spec.get("nvme_path"))
    warm = spec["warmup_steps"]
    batches = rank.batches(warm + spec["measure_steps"], engine.device)

    losses, times, cpu_times, counts, method_times = [], [], [], [], []
    memory = PeakMemory(rank.device)
    for step, row in enumerate(batches):
        if step == warm:
            gc.collect()
            rank.synchronize()
            memory.start()
        with counter.paused():
            dist.barrier()
        before, methods_before = counter.snapshot(), methods.snapshot()
        loss, wall, cpu = rank.timed_step(mode, engine, row)
        counts.append(subtract(counter.snapshot(), before))
        method_times.append(subtract(methods.snapshot(), methods_before))
        losses.append(loss)
        times.append(wall)
        cpu_times.append(cpu)
    peak = memory.stop()
    peak["baseline_rss_bytes"] = baseline_rss
    peak["allocator_fixed_threshold"] = allocator_fixed
    with counter.paused():
        dist.barrier()
    counter.uninstall()
    methods.uninstall()
    result = {
        "status": "ok",
        "rank": rank.rank,
        "world_size": rank.world,
        "parameters": n_params,
        "losses": losses,
        "times_s": times[warm:],
        "warmup_times_s": times[:warm],
        "cpu_times_s": cpu_times[warm:],
        "counts": counts[warm:],
        "warmup_counts": counts[:warm],
        "global_steps": engine.global_steps,
        "memory": peak,
    }
    if methods.targets:
        result.update(method_times=method_times[warm:], methods_absent=methods.absent)
    return result


def run_timing_trial(spec: dict) -> dict:
    """One engine per mode in ``spec["modes"]`` (plus the managed control), stepped in rotating order."""
    rank = Rank(spec)
    dist = rank.dist
    modes = list(spec["modes"]) + [CONTROL]
    engines = {}
    for index, mode in enumerate(modes):
        nvme = spec.get("nvme_path")
        engines[mode] = rank.build_engine(mode, os.path.join(nvme, str(index)) if nvme else None)[0]
    warm, measured = spec["warmup_steps"], spec["measure_steps"]
    batches = rank.batches(warm + measured, engines[modes[0]].device)
    times = {mode: [] for mode in modes}
    cpu_times = {mode: [] for mode in modes}
    losses = {mode: [] for mode in modes}
    for step, row in enumerate(batches):
        shift = step % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            dist.barrier()
            loss, wall, cpu = rank.timed_step(rank.control_of if mode == CONTROL else mode, engines[mode], row)
            losses[mode].append(loss)
            if step >= warm:
                times[mode].append(wall)
                cpu_times[mode].append(cpu)
    dist.barrier()
    return {
        "status": "ok",
        "rank": rank.rank,
        "modes": modes,
        "control_of": rank.control_of,
        "times_s": times,
        "cpu_times_s": cpu_times,
        "losses": losses,
        "global_steps": {
            mode: engine.global_steps
            for mode, engine in engines.items()
        },
    }


TRIALS = {"mode": run_mode_trial, "timing": run_timing_trial}


def run_trial(spec: dict) -> dict:
    return TRIALS[spec.get("kind", "mode")](spec)


def run_trial_safely(spec: dict) -> dict:
    try:
        return run_trial(spec)
    except Unsupported as refusal:
        return {"status": "unsupported", "reason": str(refusal)}
    except Exception as error:  # noqa: BLE001 - a refusal at the first step counts as "not supported" too
        if {configs.UNMANAGED, configs.FACTOR} & {spec.get("mode"), *spec.get("modes", ())} \
                and _mentions_flag(error):
            return {"status": "unsupported", "reason": _first_line(error)}
        return {"status": "error", "error": _first_line(error), "traceback": traceback.format_exc()}
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which decides
        return {"status": "error", "error": _first_line(error), "traceback": traceback.format_exc()}
