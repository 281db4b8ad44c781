"""Plan and run the benchmark: every configuration, micro-batch count and mode.

For one configuration and micro-batch count N:

* **Rounds of mode trials** count the collectives and measure the peak memory of each mode, each in a
  fresh trial (a fresh forked process per rank). Even rounds run managed, unmanaged, toggle; odd
  rounds the reverse.
* **One timing trial** then holds an engine per mode (plus a second managed engine, the control) and
  drives them step by step in rotating order, so b/a and c/a are measured pair by pair on
  neighbouring steps, and a′/a shows how far two identical engines drift apart on this machine.

Then, for the step-time normaliser of `gradient-divide-factor`, one more timing trial per configuration (at
``Plan.factor_micro_counts``) holds (b), (d) (raw losses and ``step(gradient_divide_factor=N * world)``)
and a second (b) engine b′, so d/b is measured against the noise b′/b.
"""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ds_bench import configs
from ds_bench.launch import LaunchError, RankPool
from ds_bench.model import ModelSize
from ds_bench.trial import CONTROL

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Plan:
    """What one device's part of a run measures."""

    device: str = "cpu"
    world_size: int = 2
    configurations: list[configs.Configuration] = field(default_factory=lambda: list(configs.CONFIGURATIONS))
    micro_counts: list[int] = field(default_factory=lambda: [1, 4, 16])
    #: Mode trials per mode (counts and memory).
    rounds: int = 3
    warmup_steps: int = 2
    #: Measured logical steps of a mode trial, by N.
    measure_steps: dict[int, int] = field(default_factory=lambda: {1: 3, 4: 2, 16: 2})
    #: Measured logical steps per engine of the timing trial, by N: more where a step is short.
    timing_steps: dict[int, int] = field(default_factory=lambda: {1: 32, 4: 16, 16: 8})
    size: ModelSize = field(default_factory=ModelSize)
    dtype: str = "fp32"
    threads: int = 1
    seed: int = 1234
    trial_timeout_s: float = 900.0
    scratch: Path = ROOT / "scratch" / "benchmarks"
    #: Run configurations even where they are skipped by default (``Configuration.skip_on``).
    force: bool = False
    #: N of the gradient_divide_factor timing trials (d against b); empty: none.
    factor_micro_counts: list[int] = field(default_factory=lambda: [1, 4])

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def steps_for(self, n_micro: int) -> int:
        return self.measure_steps.get(n_micro, max(2, round(8 / n_micro)))

    def timing_steps_for(self, n_micro: int) -> int:
        return self.timing_steps.get(n_micro, max(4, round(64 / n_micro)))

    def settings(self) -> dict:
        return {
            "world_size": self.world_size,
            "backend": self.backend,
            "micro_counts": self.micro_counts,
            "rounds": self.rounds,
            "warmup_steps": self.warmup_steps,
            "measure_steps": {
                str(n): self.steps_for(n)
                for n in self.micro_counts
            },
            "timing_steps": {
                str(n): self.timing_steps_for(n)
                for n in self.micro_counts
            },
            "model": self.size.as_dict(),
            "dtype": self.dtype,
            "threads_per_rank": self.threads,
            "bucket_elements": configs.BUCKET_ELEMENTS,
            "factor_micro_counts": self.factor_micro_counts,
        }


def trial_spec(plan: Plan,
               configuration: configs.Configuration,
               n_micro: int,
               nvme_path: Path | None,
               *,
               mode: str | None = None,
               timing_modes: list[str] | None = None,
               control_of: str = configs.MANAGED,
               extra: dict | None = None) -> dict:
    """One trial's spec (see ds_bench.trial); ``extra``: a mode trial's options (``timed_methods``)."""
    spec = {
        "device": plan.device,
        "backend": plan.backend,
        "timeout_s": plan.trial_timeout_s,
        "size": plan.size.as_dict(),
        "configuration": configuration.name,
        "n_micro": n_micro,
        "dtype": plan.dtype,
        "seed": plan.seed,
        "warmup_steps": plan.warmup_steps,
        "threads": plan.threads,
        "nvme_path": str(nvme_path) if nvme_path else None,
    }
    if timing_modes is None:
        spec.update(kind="mode", mode=mode, measure_steps=plan.steps_for(n_micro), **(extra or {}))
    else:
        spec.update(kind="timing",
                    modes=timing_modes,
                    control_of=control_of,
                    measure_steps=plan.timing_steps_for(n_micro))
    return spec


def cell_head(configuration: configs.Configuration, n_micro: int) -> dict:
    """What names a cell (configuration × N) in the results."""
    return {
        "configuration": configuration.name,
        "stage": configuration.stage,
        "offload": configuration.offload,
        "n_micro": n_micro,
    }


def combine_ranks(results: list[dict]) -> dict:
    """A mode trial's ranks -> one round: rank 0's counts, the largest peak, the slowest rank's times."""
    steps = len(results[0]["times_s"])
    step_times = [max(r["times_s"][i] for r in results) for i in range(steps)]
    step_cpu = [max(r["cpu_times_s"][i] for r in results) for i in range(steps)]
    per_step = results[0]["counts"]
    mean_counts: dict[str, dict[str, float]] = {}
    for counts in per_step:
        for op, entry in counts.items():
            slot = mean_counts.setdefault(op, {"calls": 0, "bytes": 0})
            slot["calls"] += entry["calls"]
            slot["bytes"] += entry["bytes"]
    for slot in mean_counts.values():
        for key in ("calls", "bytes"):
            value = slot[key] / steps
            slot[key] = int(value) if float(value).is_integer() else value
    gpu = [r["memory"]["peak_gpu_allocated_bytes"] for r in results]
    return {
        "counts_per_step": mean_counts,
        "counts_by_step": per_step,
        "counts_same_every_step": all(c == per_step[0] for c in per_step),
        "counts_same_every_rank": all(r["counts"] == per_step for r in results),
        "peak_rss_bytes": max(r["memory"]["peak_rss_bytes"] for r in results),
        "peak_rss_is_window": all(r["memory"]["peak_rss_is_window"] for r in results),
        # What the model and engine add to a rank's RSS: the peak less the RSS before the model existed.
        "engine_peak_rss_bytes":
        max(r["memory"]["peak_rss_bytes"] - r["memory"]["baseline_rss_bytes"] for r in results),
        "peak_gpu_allocated_bytes": max(gpu) if all(g is not None for g in gpu) else None,
        "step_times_s": step_times,
        "median_step_s": statistics.median(step_times),
        "step_cpu_s": step_cpu,
        "median_step_cpu_s": statistics.median(step_cpu),
        "losses": [r["losses"] for r in results],
        "global_steps": results[0]["global_steps"],
        "expected_global_steps": len(results[0]["losses"]),
        "parameters": results[0]["parameters"],
    }


def combine_timing(results: list[dict]) -> dict:
    """A timing trial's ranks -> per mode, the slowest rank's wall time and the busiest rank's CPU time per step."""
    modes = results[0]["modes"]
    out = {
        "modes": modes,
        "control_of": results[0].get("control_of", configs.MANAGED),
        "times_s": {},
        "cpu_times_s": {},
        "global_steps": results[0]["global_steps"]
    }
    for mode in modes:
        steps = len(results[0]["times_s"][mode])
        out["times_s"][mode] = [max(r["times_s"][mode][i] for r in results) for i in range(steps)]
        out["cpu_times_s"][mode] = [max(r["cpu_times_s"][mode][i] for r in results) for i in range(steps)]
    out["losses"] = {mode: [r["losses"][mode] for r in results] for mode in modes}
    out["expected_global_steps"] = len(results[0]["losses"][modes[0]])
    return out


def _first_error(results: list[dict]) -> dict:
    for result in results:
        if result["status"] == "error":
            return {"error": result.get("error"), "traceback": result.get("traceback", result.get("log", ""))}
    return {"error": "unknown error"}


class _Runner:
    """Runs one device's trials on a rank pool and records them into the results."""

    def __init__(self, plan: Plan, pool: RankPool, log: Callable[[str], None]):
        self.plan, self.pool, self.log = plan, pool, log

    def run(self, configuration: configs.Configuration, spec_args: dict) -> list[dict]:
        nvme = None
        if configuration.uses_nvme:
            nvme = self.plan.scratch / "nvme"
            shutil.rmtree(nvme, ignore_errors=True)
            nvme.mkdir(parents=True)
        spec = trial_spec(self.plan, configuration, spec_args.pop("n_micro"), nvme, **spec_args)
        try:
            return self.pool.run(spec, self.plan.trial_timeout_s)
        except LaunchError as error:
            return [{"status": "error", "error": str(error)}]
        finally:
            if nvme:
                shutil.rmtree(nvme, ignore_errors=True)

    def mode_rounds(self, configuration, cell: dict) -> str | None:
        """The rounds of mode trials of one cell; returns the stack's refusal of unmanaged mode, if any."""
        n_micro, refusal = cell["n_micro"], None
        for round_index in range(self.plan.rounds):
            order = configs.MODES if round_index % 2 == 0 else tuple(reversed(configs.MODES))
            for mode in order:
                entry = cell["modes"][mode]
                if entry["status"] not in ("pending", "ok"):
                    continue
                if mode != configs.MANAGED and cell["modes"][configs.MANAGED]["status"] == "error":
                    continue
                t0 = time.monotonic()
                results = self.run(configuration, {"n_micro": n_micro, "mode": mode})
                statuses = {r["status"] for r in results}
                label = f"[{self.plan.device}] {configuration.name} N={n_micro} round {round_index + 1} {mode}"
                if "error" in statuses:
                    entry.update(status="error", **_first_error(results))
                    self.log(f"{label}: ERROR {entry['error']}")
                elif "unsupported" in statuses:
                    refusal = next(r["reason"] for r in results if r["status"] == "unsupported")
                    entry.update(status="unsupported", reason=refusal)
                    self.log(f"{label}: not supported by the installed stack ({refusal})")
                else:
                    entry["status"] = "ok"
                    entry["rounds"].append({"round": round_index, **combine_ranks(results)})
                    peak = entry["rounds"][-1]["peak_rss_bytes"] / 2**20
                    self.log(f"{label}: {entry['rounds'][-1]['median_step_s'] * 1e3:.1f} ms/step, "
                             f"peak RSS {peak:.1f} MiB ({time.monotonic() - t0:.1f} s)")
        return refusal

    def timing(self, configuration, cell: dict) -> None:
        modes = [m for m in configs.MODES if cell["modes"][m]["status"] == "ok"]
        if configs.MANAGED not in modes:
            cell["timing"] = {"status": "skipped", "reason": "managed mode did not run"}
            return
        t0 = time.monotonic()
        results = self.run(configuration, {"n_micro": cell["n_micro"], "timing_modes": modes})
        label = f"[{self.plan.device}] {configuration.name} N={cell['n_micro']} timing ({', '.join(modes)}, control)"
        statuses = {r["status"] for r in results}
        if statuses != {"ok"}:
            cell["timing"] = {"status": "error", **_first_error(results)}
            self.log(f"{label}: ERROR {cell['timing']['error']}")
            return
        cell["timing"] = {"status": "ok", **combine_timing(results)}
        medians = {m: statistics.median(cell["timing"]["times_s"][m]) * 1e3 for m in cell["timing"]["modes"]}
        self.log(f"{label}: " + ", ".join(f"{m} {v:.1f} ms"
                                          for m, v in medians.items()) + f" ({time.monotonic() - t0:.1f} s)")

    def factor(self, configuration, n_micro: int) -> dict:
        """(d) against (b) and a second (b) engine, in one timing trial."""
        cell = {
            "configuration": configuration.name,
            "offload": configuration.offload,
            "n_micro": n_micro,
            "measured_steps": self.plan.timing_steps_for(n_micro)
        }
        t0 = time.monotonic()
        results = self.run(configuration, {
            "n_micro": n_micro,
            "timing_modes": [configs.UNMANAGED, configs.FACTOR],
            "control_of": configs.UNMANAGED
        })
        label = f"[{self.plan.device}] {configuration.name} N={n_micro} gradient_divide_factor timing"
        statuses = {r["status"] for r in results}
        if "unsupported" in statuses and "error" not in statuses:
            reason = next(r["reason"] for r in results if r["status"] == "unsupported")
            cell["timing"] = {"status": "unsupported", "reason": reason}
            self.log(f"{label}: not supported by the installed stack ({reason})")
        elif statuses != {"ok"}:
            cell["timing"] = {"status": "error", **_first_error(results)}
            self.log(f"{label}: ERROR {cell['timing']['error']}")
        else:
            cell["timing"] = {"status": "ok", **combine_timing(results)}
            medians = {m: statistics.median(cell["timing"]["times_s"][m]) * 1e3 for m in cell["timing"]["modes"]}
            self.log(f"{label}: " + ", ".join(f"{m} {v:.1f} ms"
                                              for m, v in medians.items()) + f" ({time.monotonic() - t0:.1f} s)")
        return cell


def _missing(plan: Plan, configuration: configs.Configuration, preload_errors: dict) -> list[str]:
    missing = []
    skip = (configuration.skip_on or {}).get(plan.device)
    if skip and not plan.force:
        missing.append(skip)
    if configuration.uses_cpu_adam and "cpu_adam" in preload_errors:
        missing.append(f"CPU Adam: {preload_errors['cpu_adam']}")
    if configuration.uses_nvme and "async_io" in preload_errors:
        missing.append(f"async_io: {preload_errors['async_io']}")
    return missing


def _preload(plan: Plan) -> list[str]:
    runnable = [c for c in plan.configurations if plan.force or not (c.skip_on or {}).get(plan.device)]
    # On CUDA the hosts must not touch the GPU before forking, so trials load their ops themselves.
    preload = ["shm_comm"] if plan.device == "cpu" else []
    if plan.device == "cpu" and any(c.uses_cpu_adam for c in runnable):
        preload.append("cpu_adam")
    if plan.device == "cpu" and any(c.uses_nvme for c in runnable):
        preload.append("async_io")
    return preload


def _measure_factor(plan: Plan, runner: _Runner, preload_errors: dict) -> list[dict]:
    cells = []
    for configuration in plan.configurations:
        if not _missing(plan, configuration, preload_errors):
            cells += [runner.factor(configuration, n_micro) for n_micro in plan.factor_micro_counts]
    return cells


def measure_factor(plan: Plan, log: Callable[[str], None] = print) -> list[dict]:
    """Only the gradient_divide_factor trials of ``plan`` (a device section's ``factor`` list)."""
    preload = _preload(plan)
    plan.scratch.mkdir(parents=True, exist_ok=True)
    with RankPool(plan.world_size, plan.device, preload, log_dir=plan.scratch / f"logs-{plan.device}") as pool:
        return _measure_factor(plan, _Runner(plan, pool, log), dict(pool.preload_errors))


def measure_device(plan: Plan, log: Callable[[str], None] = print) -> dict:
    """Run every trial of ``plan``; return the device's section of the results (see ds_bench.report)."""
    preload = _preload(plan)
    plan.scratch.mkdir(parents=True, exist_ok=True)
    section = {"device": plan.device, "settings": plan.settings(), "preload_errors": {}, "results": []}
    log(f"[{plan.device}] starting {plan.world_size} ranks (loading ops: {', '.join(preload) or 'none'})")
    started = time.monotonic()
    with RankPool(plan.world_size, plan.device, preload, log_dir=plan.scratch / f"logs-{plan.device}") as pool:
        section["preload_errors"] = dict(pool.preload_errors)
        log(f"[{plan.device}] ranks ready in {time.monotonic() - started:.0f} s")
        runner = _Runner(plan, pool, log)
        for configuration in plan.configurations:
            missing = _missing(plan, configuration, pool.preload_errors)
            if missing:
                log(f"[{plan.device}] {configuration.name}: not run here ({'; '.join(missing)})")
            refusal: str | None = None
            for n_micro in plan.micro_counts:
                cell = {
                    **cell_head(configuration, n_micro),
                    "modes": {
                        mode: {
                            "status": "pending",
                            "rounds": []
                        }
                        for mode in configs.MODES
                    },
                    "timing": {
                        "status": "pending"
                    },
                }
                section["results"].append(cell)
                if missing:
                    for entry in cell["modes"].values():
                        entry.update(status="unavailable", reason="; ".join(missing))
                    cell["timing"] = {"status": "unavailable"}
                    continue
                if refusal:
                    cell["modes"][configs.UNMANAGED].update(status="unsupported", reason=refusal)
                refusal = runner.mode_rounds(configuration, cell) or refusal
                runner.timing(configuration, cell)
        section["factor"] = _measure_factor(plan, runner, pool.preload_errors)
    return section


__all__ = ["Plan", "measure_device", "measure_factor", "trial_spec", "combine_ranks", "combine_timing", "CONTROL"]
