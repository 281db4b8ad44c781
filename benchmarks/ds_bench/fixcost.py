"""The cost of the series' bug-fix PRs for every user: pristine DeepSpeed against the same release with the fix PRs,
both in managed mode (the default).

The bug-fix PRs (``fix-*``, first in the series) change what managed mode runs: ZeRO-3 zeroes its flat
gradient-partition buffer at the end of every ``step()`` and, with optimizer offload, passes over the parameters at
``step()`` to finish the partitions the boundary backward did not reach; ZeRO-1/2 with CPU optimizer offload record
the parameters whose gradient is pending on every backward, finish them at ``step()`` and zero the fp32 gradient
partitions after it. Those passes grow with the model, so the cost is measured at the size where it would show.

Builds. DeepSpeed trees materialized by ``ds_series.stack`` under its cache (those of the tests' pristine references,
``ds_harness.support.pristine``) and imported by PYTHONPATH (nothing is installed): (a) the pinned sdist, (f) the sdist
plus the series' fix PRs, optionally (g) the sdist plus the fix PRs of another patches folder (a later version of the
same PRs), and (a′) the pristine tree again, the control: what two identical builds differ by on this machine.

Rounds. Per configuration and round, one managed-mode trial per build, one after another (a fresh forked process per
rank, its own engine from the same weights and data), in an order rotated from round to round. Each trial's median
step is compared with the pristine trial of its round (f/a, g/a, a′/a), so slow drifts of a shared machine cancel
round by round; the 1-minute load average is recorded before and after every trial. The trials also time the
methods the fixes add or change (:data:`BASES`, :mod:`ds_bench.method_timer`): the fix's own per-step work, directly.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ds_bench import configs
from ds_bench.launch import RankPool
from ds_bench.model import ModelSize, build_model
from ds_bench.run import Plan, _first_error, _preload, _Runner

ROOT = Path(__file__).resolve().parents[2]

PRISTINE, FIXES, AFTER, CONTROL = "pristine", "fixes", "fixes_after", "pristine_control"
LETTER = {PRISTINE: "a", FIXES: "f", AFTER: "g", CONTROL: "a′"}

#: ZeRO-2 and ZeRO-3 with CPU optimizer offload: where the fixes' per-step passes grow with the model.
CONFIGURATIONS = ("z2-opt-cpu", "z3-opt-cpu")
SIZES = {
    # 8 blocks of width 1,024: 105 M parameters in 101 tensors, every one above ZeRO-3's persistence threshold.
    "100m": ModelSize(vocab=2048, d_model=1024, n_heads=8, n_layers=8, d_ff=4096, seq_len=16, micro_batch=2),
    # The first study's model: 1,013 small tensors, 2.9 M parameters (per-tensor overheads show).
    "2.9m": ModelSize(vocab=512, d_model=64, n_heads=2, n_layers=84, d_ff=128, seq_len=16, micro_batch=2),
    # ``--quick``: a smoke run.
    "quick": ModelSize(vocab=64, d_model=8, n_heads=2, n_layers=4, d_ff=16, seq_len=8, micro_batch=2),
}

_STAGE3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3."
_STAGE12 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer."
_ALLGATHER = "deepspeed.runtime.zero.partition_parameters:Init._allgather_params_coalesced"

#: Per base, the methods timed in every trial: the ZeRO optimizers' ``step()`` (everything the fixes add runs inside
#: it, but the pending-id bookkeeping of ZeRO-1/2 offload backwards), the fixes' new methods and those whose work they
#: change. A method a build lacks is recorded as absent.
TIMED_METHODS = {
    "0.19.3": (_STAGE3 + "step", _STAGE3 + "_clear_grad_partitions",
               _STAGE3 + "_copy_unreached_grad_partitions_to_fp32_partitions", _ALLGATHER, _STAGE12 + "step",
               _STAGE12 + "_finalize_offloaded_gradients", _STAGE12 + "reset_cpu_buffers"),
    "0.19.8":
    (_STAGE3 + "step", _STAGE3 + "_clear_grad_partitions", _STAGE3 + "_finalize_offload_gradient_accumulation",
     _STAGE12 + "step", _STAGE12 + "_finalize_cpu_offload_gradient_accumulation",
     _STAGE12 + "_copy_accumulated_grad_to_fp32_partition", _STAGE12 + "reset_cpu_buffers"),
}


def short_method(target: str) -> str:
    """``module:Class.method`` -> ``Class.method``."""
    return target.partition(":")[2]


def installed_base() -> str:
    """The release the installed DeepSpeed is built on (``0.19.8+gafollowups.9`` -> ``0.19.8``)."""
    from importlib.metadata import version
    return version("deepspeed").partition("+")[0]


@dataclass
class Build:
    """One DeepSpeed tree: the pinned sdist plus ``prs``, imported from ``tree`` by PYTHONPATH."""

    name: str
    prs: list[str]
    tree: Path
    #: A ``deepspeed/ops`` folder whose JIT ops build from the same sources as the tree's: first on the path, its op
    #: builders load the ops built there once (in ``extensions_dir``) for every build. None: the tree builds its own.
    shared_ops: Path | None = None
    #: Where the JIT ops are built; None: torch's default (the installed DeepSpeed's).
    extensions_dir: Path | None = None
    #: The patches folder the PRs came from.
    patches: str = ""

    def env(self) -> dict[str, str]:
        """What a rank host of this build adds to its environment (our own packages come from the virtualenv)."""
        paths = ([str(self.shared_ops)] if self.shared_ops else []) + [str(self.tree)]
        env = {"PYTHONPATH": os.pathsep.join(paths)}
        if self.extensions_dir is not None:
            env["TORCH_EXTENSIONS_DIR"] = str(self.extensions_dir)
        return env


def _same_files(a: Path, b: Path) -> bool:
    from ds_harness.support.pristine import _files
    return _files(a) == _files(b)


def prepare_builds(base: str,
                   after: Path | None = None,
                   log: Callable[[str], None] = print,
                   fixes: Path | None = None) -> dict[str, Build]:
    """The pristine tree, the fix-prefix tree of ``base`` (of the ``fixes`` folder, default this checkout's
    ``patches/deepspeed-<base>/``) and, with ``after`` (another such folder), its fix prefix (each materialized on
    first use, then cached). Builds whose ops are those of the installed DeepSpeed reuse its JIT ops; otherwise all
    load the ops of the pristine tree, built once beside it."""
    from ds_harness.support import pristine
    from ds_series import stack

    base_info = stack.load_base(base)
    fixed = dataclasses.replace(base_info, folder=Path(fixes).resolve()) if fixes else base_info
    sources = [(PRISTINE, base_info, []), (FIXES, fixed, pristine.bug_fix_prefix(fixed))]
    if after is not None:
        other = dataclasses.replace(base_info, folder=Path(after).resolve())
        sources.append((AFTER, other, pristine.bug_fix_prefix(other)))
    builds: dict[str, Build] = {}
    for name, info, prs in sources:
        started = time.monotonic()
        tree = pristine._reference_tree(info, prs)
        build = Build(name, [p.name for p in prs], tree, patches=str(info.folder))
        installed = pristine._installed_ops_with_the_same_sources(tree)
        first_ops = builds[PRISTINE].tree / "deepspeed" / "ops" if builds else tree / "deepspeed" / "ops"
        if installed is not None:
            build.shared_ops = installed
        elif _same_files(tree / "deepspeed" / "ops", first_ops):
            build.shared_ops, build.extensions_dir = first_ops, first_ops.parents[2] / "torch_extensions"
        else:
            build.extensions_dir = tree.parent / "torch_extensions"
        builds[name] = build
        log(f"{name}: {tree} ({len(prs)} PR(s): {', '.join(build.prs) or 'none'}; ops from "
            f"{build.shared_ops or 'the tree'}; {time.monotonic() - started:.0f} s)")
    for name in (FIXES, AFTER):
        if name in builds and not builds[name].prs:
            raise RuntimeError(f"{builds[name].patches} has no bug-fix PR to measure")
    return builds


# --- records --------------------------------------------------------------------------------------------------------


@dataclass
class Trial:
    """One build's managed-mode trial in one round: the slowest rank's times per measured step."""

    role: str
    round: int
    #: Place in its round's order (0 = first).
    place: int
    step_s: list[float]
    cpu_s: list[float]
    peak_rss_bytes: int
    #: 1-minute load average before and after the trial.
    load: tuple[float, float]
    #: Per timed method (``Class.method``): the slowest rank's seconds per measured step.
    methods_s: dict[str, list[float]] = field(default_factory=dict)
    #: Per timed method: rank 0's calls in the first measured step.
    method_calls: dict[str, int] = field(default_factory=dict)
    methods_absent: list[str] = field(default_factory=list)
    #: Rank 0's collectives per measured step (op -> calls, bytes).
    collectives: list[dict] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


@dataclass
class Cell:
    """One configuration at one N: every round's trials, and the errors of trials that failed."""

    configuration: str
    n_micro: int
    trials: list[Trial] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)

    def of(self, role: str) -> list[Trial]:
        return [t for t in self.trials if t.role == role]

    def ratios(self, role: str, of=lambda t: t.median_s) -> list[float]:
        """Per round with both trials: ``role``'s median step over pristine's."""
        base = {t.round: of(t) for t in self.of(PRISTINE)}
        return [of(t) / base[t.round] for t in self.of(role) if t.round in base]


@dataclass
class Study:
    """One run of ``python -m ds_bench fixcost``."""

    command: str
    started: str
    base: str
    size_name: str
    size: ModelSize
    parameters: int
    parameter_tensors: int
    world_size: int
    threads_per_rank: int
    warmup_steps: int
    measure_steps: int
    rounds: int
    nice: int
    machine: dict
    builds: dict[str, Build]
    #: The roles in their first round's order.
    roles: list[str]
    timed_methods: list[str]
    cells: list[Cell] = field(default_factory=list)
    finished: str = ""
    quick: bool = False

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        for build in data["builds"].values():
            for key in ("tree", "shared_ops", "extensions_dir"):
                build[key] = str(build[key]) if build[key] else None
        return data

    @classmethod
    def from_json(cls, data: dict) -> Study:
        data = dict(data)
        data["size"] = ModelSize(**data["size"])
        data["builds"] = {
            k:
            Build(
                **{
                    **b, "tree": Path(b["tree"]),
                    "shared_ops": Path(b["shared_ops"]) if b["shared_ops"] else None,
                    "extensions_dir": Path(b["extensions_dir"]) if b["extensions_dir"] else None
                })
            for k, b in data["builds"].items()
        }
        data["cells"] = [
            Cell(**{
                **c, "trials": [Trial(**{
                    **t, "load": tuple(t["load"])
                }) for t in c["trials"]]
            }) for c in data["cells"]
        ]
        return cls(**data)


# --- measurement ----------------------------------------------------------------------------------------------------


def make_plan(size: ModelSize, warmup_steps: int, measure_steps: int, n_micro: int) -> Plan:
    """The main benchmark's plan with this measurement's model and steps (fp32, 2 CPU ranks, gloo, 1 thread each)."""
    return Plan(device="cpu",
                world_size=2,
                configurations=[],
                micro_counts=[n_micro],
                rounds=1,
                warmup_steps=warmup_steps,
                measure_steps={n_micro: measure_steps},
                size=size,
                dtype="fp32",
                threads=1,
                scratch=ROOT / "scratch" / "benchmarks-fixcost",
                trial_timeout_s=1800.0,
                factor_micro_counts=[])


def model_shape(size: ModelSize) -> tuple[int, int]:
    """(parameters, parameter tensors) of the benchmark model at ``size``."""
    model = build_model(size)
    return sum(p.numel() for p in model.parameters()), len(list(model.parameters()))


def round_order(roles: list[str], round_index: int) -> list[str]:
    """The builds' order in a round: rotated every round, so each takes each place equally often."""
    shift = round_index % len(roles)
    return roles[shift:] + roles[:shift]


def trial_of(role: str, round_index: int, place: int, results: list[dict], load: tuple[float, float]) -> Trial:
    """A mode trial's ranks -> one :class:`Trial` (the slowest rank's times, the largest peak, rank 0's counts)."""
    steps = len(results[0]["times_s"])
    slowest = lambda key: [max(r[key][i] for r in results) for i in range(steps)]  # noqa: E731
    trial = Trial(role=role,
                  round=round_index,
                  place=place,
                  step_s=slowest("times_s"),
                  cpu_s=slowest("cpu_times_s"),
                  peak_rss_bytes=max(r["memory"]["peak_rss_bytes"] for r in results),
                  load=load,
                  methods_absent=[short_method(m) for m in results[0].get("methods_absent", [])],
                  collectives=results[0]["counts"],
                  losses=[r["losses"] for r in results])
    if "method_times" in results[0]:
        names = sorted(set().union(*(step for r in results for step in r["method_times"])))
        for name in names:
            short = short_method(name)
            trial.methods_s[short] = [
                max(r["method_times"][i].get(name, {}).get("seconds", 0.0) for r in results) for i in range(steps)
            ]
            trial.method_calls[short] = results[0]["method_times"][0].get(name, {}).get("calls", 0)
    return trial


def check_builds(pools: dict[str, RankPool], builds: dict[str, Build], roles: list[str]) -> None:
    """Raises unless every pool's hosts imported their own build's tree."""
    for role in roles:
        tree = builds[PRISTINE if role == CONTROL else role].tree
        for rank, info in enumerate(pools[role].deepspeed):
            if not str(info.get("file", "")).startswith(str(tree) + os.sep):
                raise RuntimeError(f"{role} rank {rank} imported DeepSpeed from {info.get('file')}, not from {tree}")


def measure(study: Study,
            plan: Plan,
            configurations: list[str],
            log: Callable[[str], None] = print,
            save: Callable[[Study], None] = lambda study: None) -> Study:
    """Every round of every configuration into ``study.cells``, calling ``save(study)`` after each round."""
    plan.configurations = [configs.BY_NAME[name] for name in configurations]
    preload = _preload(plan)
    plan.scratch.mkdir(parents=True, exist_ok=True)
    n_micro = plan.micro_counts[0]
    with ExitStack() as exits:
        pools = {}
        for role in study.roles:
            started = time.monotonic()
            build = study.builds[PRISTINE if role == CONTROL else role]
            pools[role] = exits.enter_context(
                RankPool(plan.world_size, plan.device, preload, log_dir=plan.scratch / f"logs-{role}",
                         env=build.env()))
            log(f"({LETTER[role]}) {role}: {plan.world_size} rank hosts ready in {time.monotonic() - started:.0f} s")
        check_builds(pools, study.builds, study.roles)
        errors = {op: reason for pool in pools.values() for op, reason in pool.preload_errors.items()}
        if errors:
            raise RuntimeError(f"the rank hosts could not load DeepSpeed's ops: {errors}")
        runners = {role: _Runner(plan, pool, log) for role, pool in pools.items()}
        cells = [Cell(name, n_micro) for name in configurations]
        study.cells = cells
        for round_index in range(study.rounds):
            # Configurations alternate within a round, so a slow stretch of the machine touches both.
            for cell in cells:
                configuration = configs.BY_NAME[cell.configuration]
                for place, role in enumerate(round_order(study.roles, round_index)):
                    label = f"{cell.configuration} N={n_micro} round {round_index + 1} ({LETTER[role]})"
                    started, load_before = time.monotonic(), os.getloadavg()[0]
                    results = runners[role].run(configuration, {
                        "n_micro": n_micro,
                        "mode": configs.MANAGED,
                        "extra": {
                            "timed_methods": study.timed_methods
                        }
                    })
                    if any(r["status"] != "ok" for r in results):
                        error = _first_error(results) if any(r["status"] == "error" for r in results) else {
                            "error": next(r.get("reason") for r in results if r["status"] != "ok")
                        }
                        cell.errors.append({"role": role, "round": round_index, **error})
                        log(f"{label}: ERROR {error['error']}")
                        continue
                    trial = trial_of(role, round_index, place, results, (load_before, os.getloadavg()[0]))
                    cell.trials.append(trial)
                    log(f"{label}: {trial.median_s * 1e3:.0f} ms/step (min {min(trial.step_s) * 1e3:.0f}), "
                        f"peak RSS {trial.peak_rss_bytes / 2**20:.0f} MiB, "
                        f"load {trial.load[0]:.1f}-{trial.load[1]:.1f} "
                        f"({time.monotonic() - started:.0f} s)")
                save(study)
    return study
