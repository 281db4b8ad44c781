"""The tooling of ``python -m ds_bench fixcost`` (no DeepSpeed, no timing asserted).

* The lockstep: trials in other processes take their steps one at a time, in the order the launcher gives, and a
  trial that leaves ends the lockstep with an error instead of a hang.
* The method timer counts calls and time of the named methods, lists the ones the code lacks, and restores them.
* The report pairs the builds' steps one by one (f/a and a′/a), treats NaN losses of both builds as equal, and
  renders a page with the verdicts, from a synthetic record.
"""

from __future__ import annotations

import json
import math
import threading
import time

import pytest


from ds_bench import fixcost, fixcost_report
from ds_bench.comm_counter import subtract
from ds_bench.lockstep import Conductor, LockstepError, Turns
from ds_bench.method_timer import MethodTimer


# -- lockstep -------------------------------------------------------------------------------------------------
def _participant(conductor, role, steps, log, inside):
    turns = Turns(conductor.address(role), rank=0, timeout_s=10)
    try:
        for step in range(steps):
            turns.wait()
            inside.append(role)
            assert len(inside) == 1, f"{inside} step at once"
            log.append((step, role))
            time.sleep(0.001)
            inside.remove(role)
            turns.done()
    finally:
        turns.close()


def test_lockstep_takes_turns_in_the_given_order():
    roles, steps = list(fixcost.ROLES), 4
    conductor = Conductor(roles, timeout_s=10)
    log, inside = [], []
    threads = [
        threading.Thread(target=_participant, args=(conductor, role, steps, log, inside), daemon=True)
        for role in roles
    ]
    for thread in threads:
        thread.start()
    try:
        conductor.accept(alive=lambda: all(t.is_alive() for t in threads))
        conductor.run(steps, fixcost.step_order)
    finally:
        conductor.close()
    for thread in threads:
        thread.join(10)
    assert log == [(step, role) for step in range(steps) for role in fixcost.step_order(step)]


def test_lockstep_ends_with_an_error_when_a_trial_leaves():
    conductor = Conductor(["a", "b"], timeout_s=10)
    stays = Turns(conductor.address("a"), rank=0, timeout_s=10)
    leaves = Turns(conductor.address("b"), rank=0, timeout_s=10)
    try:
        conductor.accept()
        leaves.close()  # the trial's process ended
        with pytest.raises(LockstepError):
            conductor.run(2, lambda step: ["b", "a"])
    finally:
        conductor.close()
    with pytest.raises((LockstepError, OSError)):
        stays.wait()  # the launcher closed: the waiting trial fails instead of hanging
    stays.close()


def test_lockstep_reports_a_trial_that_never_connects():
    conductor = Conductor(["a"], timeout_s=10)
    try:
        with pytest.raises(LockstepError, match="ended before"):
            conductor.accept(alive=lambda: False)
    finally:
        conductor.close()


def test_turns_without_lockstep_or_on_other_ranks_do_nothing():
    for turns in (Turns(None, rank=0, timeout_s=1), Turns({"port": 1, "role": "a"}, rank=1, timeout_s=1)):
        turns.wait()
        turns.done()
        turns.close()


def test_step_order_puts_every_pool_in_every_place():
    orders = [fixcost.step_order(step) for step in range(3)]
    for place in range(3):
        assert sorted(order[place] for order in orders) == sorted(fixcost.ROLES)
    assert fixcost.step_order(3) == fixcost.step_order(0)


# -- method timer ---------------------------------------------------------------------------------------------
class _Base:

    def inherited(self):
        return "base"


class _Optimizer(_Base):

    def step(self, depth=0):
        if depth:
            self.step(depth - 1)  # a nested call: its time counts once
        time.sleep(0.002)
        return depth


def test_method_timer_counts_restores_and_lists_absent_methods():
    module = __name__
    targets = [
        f"{module}:_Optimizer.step", f"{module}:_Optimizer.inherited", f"{module}:_Optimizer.missing",
        "no.such.module:Class.method"
    ]
    own, inherited = _Optimizer.__dict__["step"], _Base.__dict__["inherited"]
    timer = MethodTimer(targets).install()
    try:
        before = timer.snapshot()
        optimizer = _Optimizer()
        assert optimizer.step(2) == 2
        assert optimizer.inherited() == "base"
        diff = subtract(timer.snapshot(), before)
    finally:
        timer.uninstall()
    assert timer.absent == targets[2:]
    assert diff[targets[0]]["calls"] == 3
    assert 0.006 <= diff[targets[0]]["seconds"] < 10  # three sleeps of 2 ms, counted once each, not nested twice
    assert diff[targets[1]]["calls"] == 1
    assert _Optimizer.__dict__["step"] is own
    assert "inherited" not in _Optimizer.__dict__ and _Base.__dict__["inherited"] is inherited


def test_subtract_handles_any_numeric_fields():
    after = {"x": {"calls": 3, "seconds": 0.5}, "y": {"calls": 1, "bytes": 8}}
    before = {"x": {"calls": 1, "seconds": 0.5}, "y": {"calls": 1, "bytes": 8}}
    assert subtract(after, before) == {"x": {"calls": 2, "seconds": 0.0}}


# -- builds ---------------------------------------------------------------------------------------------------
def test_build_env_reuses_installed_ops_or_builds_beside_the_tree(tmp_path):
    tree = tmp_path / "trees" / "abc" / "deepspeed"
    reused = fixcost.Build("pristine", [], tree, tmp_path / "site" / "deepspeed" / "ops").env()
    assert reused == {"PYTHONPATH": f"{tmp_path / 'site' / 'deepspeed' / 'ops'}:{tree}"}
    own = fixcost.Build("fixes", ["fix-a"], tree, None).env()
    assert own == {"PYTHONPATH": str(tree), "TORCH_EXTENSIONS_DIR": str(tree.parent / "torch_extensions")}


# -- report ---------------------------------------------------------------------------------------------------
def _trial(times, losses, peak, methods=None, counts=None, rounds=0, absent=fixcost.BASES["0.19.3"].fix_only):
    counts = counts or {"all_reduce": {"calls": 2, "bytes": 100}}
    return {
        "round": rounds,
        "load_1min": [3.0, 4.0],
        "step_times_s": times,
        "step_cpu_s": [t / 2 for t in times],
        "median_step_s": sorted(times)[len(times) // 2],
        "counts_per_step": counts,
        "counts_by_step": [counts] * len(times),
        "counts_same_every_step": True,
        "counts_same_every_rank": True,
        "peak_rss_bytes": peak,
        "engine_peak_rss_bytes": peak // 2,
        "peak_gpu_allocated_bytes": None,
        "losses": [losses, losses],
        "global_steps": len(losses),
        "expected_global_steps": len(losses),
        "parameters": 1000,
        "method_times_by_step": [methods or {}] * len(times),
        "methods_absent": list(absent),
    }


def _record():
    nan = float("nan")
    base = [1.0, 2.0, 1.0, 2.0]
    step3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.step"
    clear = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._clear_grad_partitions"
    step = {step3: {"calls": 1, "seconds": 0.2}}
    step_and_clear = {**step, clear: {"calls": 1, "seconds": 0.011}}
    # f/a is 1.10 at every step: above the target and outside a′/a, whatever the noise of the times themselves
    slower = [1.1 * t for t in base]
    cell = {
        "configuration": "z3",
        "stage": 3,
        "offload": "none",
        "n_micro": 1,
        "errors": [],
        "trials": {
            fixcost.PRISTINE: [_trial(base, [4.0, nan, 3.0], 100 * 2**20, step)],
            fixcost.FIXES: [_trial(slower, [4.0, nan, 3.0], 100 * 2**20 + 2**19, step_and_clear, absent=())],
            fixcost.CONTROL: [_trial(list(base), [4.0, nan, 3.0], 100 * 2**20, step)],
        },
    }
    return {
        "command": "python -m ds_bench fixcost",
        "finished": "2026-12-03T00:00:00+00:00",
        "quick": False,
        "machine": {
            "cpu": "CPU",
            "cpu_count": 2,
            "memory_gib": 8,
            "os": "Linux",
            "python": "3.11",
            "torch": "2",
            "cuda_devices": []
        },
        "builds": {
            fixcost.PRISTINE: {
                "prs": [],
                "tree": "/t/p",
                "installed_ops": "/ops",
                "torch_extensions_dir": "/x"
            },
            fixcost.FIXES: {
                "prs": ["fix-a", "fix-b"],
                "tree": "/t/f",
                "installed_ops": "/ops",
                "torch_extensions_dir": "/x"
            },
        },
        "imported": {
            role: {
                "version": "0.19.3",
                "file": "/t/x/deepspeed/__init__.py"
            }
            for role in fixcost.ROLES
        },
        "settings": {
            "world_size": 2,
            "backend": "gloo",
            "rounds": 1,
            "warmup_steps": 1,
            "measure_steps": {
                "1": 4
            },
            "model": fixcost.SIZE.as_dict(),
            "dtype": "fp32",
            "threads_per_rank": 1,
            "bucket_elements": 1_000_000,
            "parameter_tensors": 1013,
            "parameters": 2_878_336
        },
        "cells": [cell],
    }


def test_report_pairs_steps_and_renders_the_verdicts(tmp_path):
    data = json.loads(json.dumps(fixcost_report.analyze(_record())))  # the record survives JSON
    cell = data["cells"][0]
    fixes, control = cell["comparisons"][fixcost.FIXES], cell["comparisons"][fixcost.CONTROL]
    assert fixes["time_ratio"] == pytest.approx(1.1) and fixes["pairs"] == 4
    assert control["time_ratio"] == pytest.approx(1.0)
    assert fixes["max_loss_difference"] == 0 and fixes["same_losses"]  # NaN on both builds counts as equal
    assert fixes["memory_ratio"] == pytest.approx(1.005) and fixes["same_collectives"]
    assert cell["verdicts"] == {
        "time": False,
        "time_within_noise": False,
        "memory": True,
        "collectives": True,
        "same_update": True
    }
    clear = next(m for m in cell["methods"] if m["fix_only"])
    assert clear[fixcost.FIXES]["median_s"] == pytest.approx(0.011) and clear[fixcost.PRISTINE] is None
    assert clear["share_of_fixes_step"] == pytest.approx(0.011 / fixes["median_step_s"])
    assert cell["builds_as_expected"]

    analysis = tmp_path / "analysis.md"
    analysis.write_text("<!-- run: 2026-12-03T00:00:00+00:00 -->\nHand-written.")
    page = fixcost_report.render(data, analysis)
    assert "| z3 | none | 1 |" in page and "❌ time" in page
    assert "Hand-written." in page and "Written for the run of" not in page
    assert "`DeepSpeedZeroOptimizer_Stage3._clear_grad_partitions (new)`" in page
    assert "f/a 1.100 over 4 step pairs" in page


def test_report_notices_a_build_that_is_not_what_it_claims():
    data = _record()
    data["cells"][0]["trials"][fixcost.FIXES][0]["methods_absent"] = list(fixcost.BASES["0.19.3"].fix_only)
    assert not fixcost_report.analyze(data)["cells"][0]["builds_as_expected"]
    assert "what they claim (the fixes' new methods absent from every pristine trial, present in every fix trial): " \
        "0 of 1" in fixcost_report.render(data)


def test_loss_difference_is_infinite_where_only_one_build_is_finite():
    nan = float("nan")
    assert fixcost_report.loss_difference([[1.0, nan]], [[1.0, nan]]) == 0
    assert fixcost_report.loss_difference([[1.0, 2.0]], [[1.0, nan]]) == math.inf
    assert fixcost_report.loss_difference([[1.0, 2.0]], [[1.5, 2.0]]) == 0.5


def test_a_0198_record_is_read_with_0198s_fixes():
    """The record names its base; the fixes' methods and the page's words are that base's (0.19.8 has no all-gather
    fix and its ZeRO-1/2 offload fix adds ``_copy_accumulated_grad_to_fp32_partition``)."""
    data = _record()
    data["base"] = "0.19.8"
    copy = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._copy_accumulated_grad_to_fp32_partition"
    assert copy in fixcost.BASES["0.19.8"].fix_only
    trials = data["cells"][0]["trials"]
    for role in (fixcost.PRISTINE, fixcost.CONTROL):
        trials[role][0]["methods_absent"] = list(fixcost.BASES["0.19.8"].fix_only)
    assert fixcost_report.analyze(data)["cells"][0]["builds_as_expected"]
    trials[fixcost.FIXES][0]["methods_absent"] = [copy]  # a fix build without the copy 0.19.8's fix adds
    assert not fixcost_report.analyze(data)["cells"][0]["builds_as_expected"]
    page = fixcost_report.render(fixcost_report.analyze(data))
    assert "pristine DeepSpeed 0.19.8 **(a)** against 0.19.8 with the fix PRs" in page
    assert "`fix-zero3-allgather-wait`" not in page and "benchmarks/results/benchmarks-fixcost-0.19.8.json" in page
    assert fixcost_report.analysis_of("0.19.8").name == "fixcost-analysis-0.19.8.md"
