"""The cost of the series' bug-fix PRs for every user: pristine DeepSpeed against the same release with the fix PRs,
both in managed mode (the default), on the base of the installed DeepSpeed (0.19.3 or 0.19.8).

The bug-fix PRs (``fix-*``, first in the series) change what managed mode runs: ZeRO-3 waits for every coalesced
all-gather, zeroes its flat gradient-partition buffer at the end of every ``step()`` and, with optimizer offload,
passes over the parameters at ``step()`` to finish the partitions the boundary backward did not reach; ZeRO-1/2 with
CPU optimizer offload record the parameters whose gradient is pending on every backward, finish them at ``step()``
and zero the fp32 gradient partitions after it.

Builds. Two DeepSpeed trees, the pinned sdist alone and the sdist plus the fix PRs, materialized by
``ds_series.stack`` under its cache and imported by PYTHONPATH (nothing is installed): the trees, and the reuse of the
installed DeepSpeed's JIT-built ops where their sources are the same, are those of the tests' pristine references
(``ds_harness.support.pristine``).

Trials. Three pools of rank hosts (:class:`ds_bench.launch.RankPool`; a host imports its DeepSpeed once): (a) the
pristine tree, (f) the fix prefix, and (a′) the pristine tree again, the control. For each configuration and N, a
round starts one managed-mode trial on every pool at once (a fresh forked process per rank: the main benchmark's mode
trial, which counts the collectives and measures the peak RSS of its own process) and the trials take their steps in
turn (:mod:`ds_bench.lockstep`), in rotating order (a, f, a′; f, a′, a; a′, a, f; ...), so that only one build
computes at a time, each engine is built once per round, and f/a and a′/a are ratios of neighbouring steps, as in the
main benchmark's timing trial: a′/a is what two identical builds differ by on this machine. The trials also time the
fixes' own methods and the ones they change (:data:`BASES`, :mod:`ds_bench.method_timer`).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ds_bench import configs
from ds_bench.launch import RankPool
from ds_bench.lockstep import Conductor, LockstepError
from ds_bench.model import ModelSize, build_model
from ds_bench.run import Plan, _first_error, _preload, _Runner, cell_head, combine_ranks

ROOT = Path(__file__).resolve().parents[2]

PRISTINE, FIXES, CONTROL = "pristine", "fixes", "pristine_control"
#: The pools, in the order of the first round; later rounds rotate it.
ROLES = (PRISTINE, FIXES, CONTROL)
LETTER = {PRISTINE: "a", FIXES: "f", CONTROL: "a′"}
#: The build each pool imports: the control is a second pool of the pristine tree.
BUILD_OF = {PRISTINE: PRISTINE, FIXES: FIXES, CONTROL: PRISTINE}

#: ZeRO-3, ZeRO-3 with CPU optimizer offload, ZeRO-2 and ZeRO-1 with CPU optimizer offload: the paths the fixes change.
CONFIGURATIONS = ("z3", "z3-opt-cpu", "z2-opt-cpu", "z1-opt-cpu")
#: 84 transformer blocks of 12 parameter tensors each, plus 5: 1,013 tensors, 2.9 M parameters. The fixes' passes
#: are per tensor, so many small ones show their cost; in ZeRO-3, 11 of a block's 12 tensors lie within the
#: persistence threshold (10,000 elements), so every step re-gathers 927 persistent tensors with one all-gather each.
SIZE = ModelSize(vocab=512, d_model=64, n_heads=2, n_layers=84, d_ff=128, seq_len=16, micro_batch=2)
#: ``--quick``: as many tensors, a few elements each.
QUICK_SIZE = ModelSize(vocab=64, d_model=8, n_heads=2, n_layers=84, d_ff=16, seq_len=8, micro_batch=2)

_STAGE3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3."
_STAGE12 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer."
_ALLGATHER = "deepspeed.runtime.zero.partition_parameters:Init._allgather_params_coalesced"


@dataclass(frozen=True)
class FixesOfBase:
    """What one base's bug-fix PRs add to managed mode: the methods timed, and the words of the page."""

    #: Timed in every trial: the ZeRO optimizers' ``step()`` (both builds: everything the fixes add runs inside it,
    #: but for the pending-id bookkeeping of ZeRO-1/2 offload backwards), the fixes' new methods (f only) and the
    #: methods whose work they change (both builds).
    timed_methods: Tuple[str, ...]
    #: Methods the fix PRs add: the pristine build must lack them and the fix build have them (a check of the builds).
    fix_only: Tuple[str, ...]
    #: What every managed-mode user runs with the fixes, after "so every user runs their code: ".
    work: str
    #: The page's note on the timed methods that are not ``step`` or new.
    methods_note: str


BASES = {
    "0.19.3":
    FixesOfBase(
        timed_methods=(_STAGE3 + "step", _STAGE3 + "_clear_grad_partitions",
                       _STAGE3 + "_copy_unreached_grad_partitions_to_fp32_partitions", _ALLGATHER, _STAGE12 + "step",
                       _STAGE12 + "_finalize_offloaded_gradients", _STAGE12 + "reset_cpu_buffers"),
        fix_only=(_STAGE3 + "_clear_grad_partitions", _STAGE3 + "_copy_unreached_grad_partitions_to_fp32_partitions",
                  _STAGE12 + "_finalize_offloaded_gradients"),
        work="ZeRO-3 waits for every coalesced all-gather, zeroes its flat gradient-partition buffer at the end of "
        "every `step()` and, with optimizer offload, passes over the parameters at `step()` for the partitions the "
        "boundary backward did not reach; ZeRO-1/2 with CPU optimizer offload record the parameters whose gradient is "
        "pending on every backward, finish them at `step()` and zero the fp32 gradient partitions after it.",
        methods_note="`Init._allgather_params_coalesced` re-gathers the persistent parameters, whose every all-gather "
        "`fix-zero3-allgather-wait` waits for."),
    "0.19.8":
    FixesOfBase(
        timed_methods=(_STAGE3 + "step", _STAGE3 + "_clear_grad_partitions",
                       _STAGE3 + "_finalize_offload_gradient_accumulation", _STAGE12 + "step",
                       _STAGE12 + "_finalize_cpu_offload_gradient_accumulation",
                       _STAGE12 + "_copy_accumulated_grad_to_fp32_partition", _STAGE12 + "reset_cpu_buffers"),
        fix_only=(_STAGE3 + "_clear_grad_partitions", _STAGE12 + "_copy_accumulated_grad_to_fp32_partition"),
        work="ZeRO-3 zeroes its flat gradient-partition buffer at the end of every `step()` and, with optimizer "
        "offload, runs 0.19.8's unmanaged offload finalize at `step()` for the partitions the boundary backward did "
        "not reach; ZeRO-1/2 with CPU optimizer offload record the parameters whose gradient is pending on every "
        "backward, finish them at `step()` through the same finalize and zero the fp32 gradient partitions after it. "
        "(0.19.8 already has the coalesced all-gather wait, as upstream's #8539.)",
        methods_note="`_finalize_offload_gradient_accumulation` and `_finalize_cpu_offload_gradient_accumulation` are "
        "0.19.8's unmanaged offload finalizes, which the fixes run at every managed `step()` too (pristine 0.19.8 "
        "runs them only in unmanaged mode); `_copy_accumulated_grad_to_fp32_partition` is the boundary copy they "
        "share with the boundary backward."),
}


def installed_base() -> str:
    """The release the installed DeepSpeed is built on (``0.19.8+gafollowups.9`` -> ``0.19.8``): its JIT ops are the
    ones the trees reuse, so the builds measured are of that base."""
    from importlib.metadata import version
    return version("deepspeed").partition("+")[0]


def short_method(target: str) -> str:
    """``module:Class.method`` -> ``Class.method``."""
    return target.partition(":")[2]


@dataclass
class Build:
    """One DeepSpeed tree: the pinned sdist plus ``prs``, imported from ``tree`` by PYTHONPATH."""

    name: str
    prs: List[str]
    tree: Path
    #: The installed DeepSpeed's ``deepspeed/ops`` when the tree's JIT ops build from the same sources: first on the
    #: path, its op builders load the ops the installed DeepSpeed already built. None: the tree builds its own.
    installed_ops: Optional[Path]

    def env(self) -> Dict[str, str]:
        """What a rank host of this build adds to its environment (our own packages come from the virtualenv)."""
        paths = ([str(self.installed_ops)] if self.installed_ops else []) + [str(self.tree)]
        env = {"PYTHONPATH": os.pathsep.join(paths)}
        if self.installed_ops is None:  # as the tests' reference runs do: ops built beside the tree
            env["TORCH_EXTENSIONS_DIR"] = str(self.tree.parent / "torch_extensions")
        return env

    def describe(self) -> dict:
        return {
            "prs": self.prs,
            "tree": str(self.tree),
            "installed_ops": str(self.installed_ops) if self.installed_ops else None,
            "torch_extensions_dir": self.env().get("TORCH_EXTENSIONS_DIR") or os.environ.get("TORCH_EXTENSIONS_DIR"),
        }


def _pristine_support():
    """``ds_harness.support.pristine``, which materializes the trees under the stack cache and finds reusable ops."""
    from ds_harness.support import pristine
    return pristine


def prepare_builds(base: str, log: Callable[[str], None] = print) -> Dict[str, Build]:
    """The pristine tree and the fix-prefix tree of ``base`` (materialized on first use, then cached)."""
    from ds_series import stack

    pristine = _pristine_support()
    base_info = stack.load_base(base)
    builds = {}
    for name, prs in ((PRISTINE, []), (FIXES, pristine.bug_fix_prefix(base_info))):
        started = time.monotonic()
        tree = pristine._reference_tree(base_info, prs)
        builds[name] = Build(name, [p.name for p in prs], tree, pristine._installed_ops_with_the_same_sources(tree))
        ops = "the installed DeepSpeed's JIT ops" if builds[name].installed_ops else "its own JIT ops"
        log(f"{name}: {tree} ({len(prs)} PR(s): {', '.join(p.name for p in prs) or 'none'}; {ops}; "
            f"{time.monotonic() - started:.0f} s)")
    if not builds[FIXES].prs:
        raise RuntimeError(f"the {base} series has no bug-fix PR to measure")
    return builds


def make_plan(configurations: List[str],
              micro_counts: List[int],
              rounds: int,
              measure_steps: Dict[int, int],
              quick: bool = False) -> Plan:
    """The main benchmark's plan, with this measurement's model, rounds and steps (fp32, 2 CPU ranks, gloo)."""
    return Plan(
        device="cpu",
        world_size=2,
        configurations=[configs.BY_NAME[name] for name in configurations],
        micro_counts=micro_counts,
        rounds=rounds,
        warmup_steps=1 if quick else 2,
        measure_steps=dict(measure_steps),
        size=QUICK_SIZE if quick else SIZE,
        dtype="fp32",
        threads=1,
        scratch=ROOT / "scratch" / "benchmarks-fixcost",
        # A trial lives through the other pools' steps too
        trial_timeout_s=1800.0,
        factor_micro_counts=[])


def settings(plan: Plan, base: str) -> dict:
    out = {k: v for k, v in plan.settings().items() if k not in ("timing_steps", "factor_micro_counts")}
    model = build_model(plan.size)
    out.update(configurations=[c.name for c in plan.configurations],
               parameter_tensors=len(list(model.parameters())),
               parameters=sum(p.numel() for p in model.parameters()),
               timed_methods=list(BASES[base].timed_methods))
    return out


def step_order(step: int) -> List[str]:
    """The pools' order at a step: rotated every step, so each takes each place once in three steps."""
    shift = step % len(ROLES)
    return list(ROLES[shift:] + ROLES[:shift])


def combine_methods(results: List[dict]) -> dict:
    """The ranks' method times -> per measured step, rank 0's calls and the slowest rank's seconds per method."""
    if "method_times" not in results[0]:
        return {}
    by_step = []
    for step in range(len(results[0]["method_times"])):
        names = sorted(set().union(*(r["method_times"][step] for r in results)))
        by_step.append({
            name: {
                "calls": results[0]["method_times"][step].get(name, {}).get("calls", 0),
                "seconds": max(r["method_times"][step].get(name, {}).get("seconds", 0.0) for r in results),
            }
            for name in names
        })
    return {"method_times_by_step": by_step, "methods_absent": results[0].get("methods_absent", [])}


def check_builds(pools: Dict[str, RankPool], builds: Dict[str, Build]) -> Dict[str, dict]:
    """What each pool's hosts imported; raises unless every host imported its own build's tree."""
    imported = {}
    for role, pool in pools.items():
        tree = builds[BUILD_OF[role]].tree
        for rank, info in enumerate(pool.deepspeed):
            if not str(info.get("file", "")).startswith(str(tree) + os.sep):
                raise RuntimeError(f"{role} rank {rank} imported DeepSpeed from {info.get('file')}, not from {tree}")
        imported[role] = pool.deepspeed[0]
    return imported


def measure(plan: Plan,
            builds: Dict[str, Build],
            record: dict,
            base: str,
            log: Callable[[str], None] = print,
            save: Callable[[dict], None] = lambda record: None) -> dict:
    """Run every round of every cell of ``base``'s builds into ``record["cells"]``, calling ``save(record)`` after
    each cell."""
    preload = _preload(plan)
    plan.scratch.mkdir(parents=True, exist_ok=True)
    record.update(base=base,
                  settings=settings(plan, base),
                  builds={name: b.describe()
                          for name, b in builds.items()},
                  cells=[])
    with ExitStack() as exits:
        pools = {}
        for role in ROLES:
            started = time.monotonic()
            pools[role] = exits.enter_context(
                RankPool(plan.world_size,
                         plan.device,
                         preload,
                         log_dir=plan.scratch / f"logs-{role}",
                         env=builds[BUILD_OF[role]].env()))
            log(f"({LETTER[role]}) {role}: {plan.world_size} rank hosts ready in {time.monotonic() - started:.0f} s")
        record["imported"] = check_builds(pools, builds)
        errors = {op: reason for pool in pools.values() for op, reason in pool.preload_errors.items()}
        if errors:
            raise RuntimeError(f"the rank hosts could not load DeepSpeed's ops: {errors}")
        runners = {role: _Runner(plan, pool, log) for role, pool in pools.items()}
        for configuration in plan.configurations:
            for n_micro in plan.micro_counts:
                cell = {**cell_head(configuration, n_micro), "trials": {role: [] for role in ROLES}, "errors": []}
                record["cells"].append(cell)
                _run_cell(plan, configuration, cell, runners, list(BASES[base].timed_methods), log)
                save(record)
    return record


def _run_cell(plan: Plan, configuration, cell: dict, runners: Dict[str, _Runner], record_methods: List[str],
              log: Callable[[str], None]) -> None:
    """The rounds of one cell: per round, one trial per pool at once, stepping in turn (benchmarks.lockstep)."""
    n_micro = cell["n_micro"]
    steps = plan.warmup_steps + plan.steps_for(n_micro)
    for round_index in range(plan.rounds):
        label = f"{configuration.name} N={n_micro} round {round_index + 1}"
        started, loads = time.monotonic(), [os.getloadavg()[0]]
        conductor = Conductor(ROLES, plan.trial_timeout_s)
        results: Dict[str, List[dict]] = {}

        def trial(role: str) -> None:
            extra = {"timed_methods": record_methods, "lockstep": conductor.address(role)}
            results[role] = runners[role].run(configuration, {
                "n_micro": n_micro,
                "mode": configs.MANAGED,
                "extra": extra
            })

        threads = [threading.Thread(target=trial, args=(role, ), daemon=True) for role in ROLES]
        for thread in threads:
            thread.start()
        lockstep_error = None
        try:
            conductor.accept(alive=lambda: all(t.is_alive() for t in threads))
            loads.append(os.getloadavg()[0])
            # Rotated from round to round too, so that no pool always follows the same one.
            conductor.run(steps, lambda step: step_order(step + round_index))
        except LockstepError as error:
            lockstep_error = str(error)
        finally:
            conductor.close()  # a trial still waiting for a turn then fails and its ranks exit
            for thread in threads:
                thread.join()
        loads.append(os.getloadavg()[0])
        failed = {role: rs for role, rs in results.items() if any(r["status"] != "ok" for r in rs)}
        if failed or lockstep_error:
            for role, rs in failed.items():
                error = _first_error(rs) if any(r["status"] == "error" for r in rs) else {
                    "error": next(r.get("reason") for r in rs if r["status"] != "ok")
                }
                cell["errors"].append({"role": role, "round": round_index, **error})
                log(f"{label} ({LETTER[role]}) {role}: ERROR {error['error']}")
            if lockstep_error and not failed:
                cell["errors"].append({"role": None, "round": round_index, "error": lockstep_error})
                log(f"{label}: ERROR {lockstep_error}")
            continue
        for role in ROLES:
            trial_record = {"round": round_index, "load_1min": loads}
            trial_record.update(combine_ranks(results[role]))
            trial_record.update(combine_methods(results[role]))
            cell["trials"][role].append(trial_record)
        medians = ", ".join(f"{LETTER[r]} {cell['trials'][r][-1]['median_step_s'] * 1e3:.0f} ms" for r in ROLES)
        peaks = ", ".join(f"{LETTER[r]} {cell['trials'][r][-1]['peak_rss_bytes'] / 2**20:.1f}" for r in ROLES)
        log(f"{label}: {medians} per step; peak RSS {peaks} MiB; load {max(loads):.1f} "
            f"({time.monotonic() - started:.0f} s)")
