"""The tooling of ``python -m ds_bench fixcost`` (no DeepSpeed, no timing asserted).

* The rounds rotate the builds' order, so each build takes each place equally often.
* The method timer counts calls and time of the named methods, lists the ones the code lacks, and restores them.
* A trial's ranks combine into one record (slowest rank's times, largest peak), the record survives JSON, each build
  is compared with pristine round by round, NaN losses of both builds count as equal, and the page shows the
  ratios, from a synthetic study.
"""

from __future__ import annotations

import json
import time

import pytest

from ds_bench import fixcost, fixcost_report
from ds_bench.comm_counter import subtract
from ds_bench.method_timer import MethodTimer

STEP = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.step"
RESET = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.reset_cpu_buffers"


def test_round_order_puts_every_build_in_every_place():
    roles = [fixcost.PRISTINE, fixcost.FIXES, fixcost.AFTER, fixcost.CONTROL]
    orders = [fixcost.round_order(roles, r) for r in range(len(roles))]
    for place in range(len(roles)):
        assert sorted(order[place] for order in orders) == sorted(roles)
    assert fixcost.round_order(roles, len(roles)) == roles


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
def test_build_env_puts_shared_ops_first_and_names_their_extension_folder(tmp_path):
    tree = tmp_path / "trees" / "abc" / "deepspeed"
    ops = tmp_path / "trees" / "pristine" / "deepspeed" / "deepspeed" / "ops"
    shared = fixcost.Build("fixes", ["fix-a"], tree, ops, tmp_path / "ext").env()
    assert shared == {"PYTHONPATH": f"{ops}:{tree}", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    assert fixcost.Build("pristine", [], tree).env() == {"PYTHONPATH": str(tree)}


# -- records and page -----------------------------------------------------------------------------------------
def _ranks(times, peak, losses, reset_s):
    """Two ranks' results of a mode trial; rank 1 is slower by 10 % and peaks higher."""
    counts = [{"all_reduce": {"calls": 2, "bytes": 100}}] * len(times)
    return [{
        "status":
        "ok",
        "times_s": [t * scale for t in times],
        "cpu_times_s": [t * scale for t in times],
        "memory": {
            "peak_rss_bytes": peak + extra
        },
        "counts":
        counts,
        "losses":
        losses,
        "method_times": [{
            STEP: {
                "calls": 1,
                "seconds": 0.5
            },
            RESET: {
                "calls": 1,
                "seconds": reset_s * scale
            }
        } for _ in times],
        "methods_absent": [],
    } for scale, extra in ((1.0, 0), (1.1, 2**20))]


def _study(tmp_path) -> fixcost.Study:
    builds = {
        r: fixcost.Build(r, [] if r == fixcost.PRISTINE else ["fix-a"], tmp_path / r)
        for r in (fixcost.PRISTINE, fixcost.FIXES)
    }
    roles = [fixcost.PRISTINE, fixcost.FIXES, fixcost.CONTROL]
    study = fixcost.Study(command="python -m ds_bench fixcost",
                          started="s",
                          base="0.19.8",
                          size_name="quick",
                          size=fixcost.SIZES["quick"],
                          parameters=105_000_000,
                          parameter_tensors=101,
                          world_size=2,
                          threads_per_rank=1,
                          warmup_steps=1,
                          measure_steps=3,
                          rounds=2,
                          nice=-10,
                          machine={
                              "cpu": "cpu",
                              "cpu_count": 2,
                              "memory_gib": 1,
                              "os": "os",
                              "python": "3",
                              "torch": "2"
                          },
                          builds=builds,
                          roles=roles,
                          timed_methods=[STEP, RESET],
                          finished="f")
    cell = fixcost.Cell("z2-opt-cpu", 1)
    nan = float("nan")
    step = {fixcost.PRISTINE: 1.0, fixcost.FIXES: 1.05, fixcost.CONTROL: 0.98}
    for round_index in range(2):
        for place, role in enumerate(fixcost.round_order(roles, round_index)):
            seconds = [step[role] * (1 + round_index), step[role] * (1 + round_index) * 2, step[role]]
            results = _ranks(seconds, 100 * 2**20, [4.0, nan, 3.0], 0.02 if role == fixcost.FIXES else 0.01)
            cell.trials.append(fixcost.trial_of(role, round_index, place, results, (1.0, 2.0)))
    study.cells = [cell]
    return study


def test_trial_takes_the_slowest_rank_and_the_largest_peak(tmp_path):
    trial = _study(tmp_path).cells[0].of(fixcost.FIXES)[0]
    assert trial.step_s == pytest.approx([1.05 * 1.1, 2.1 * 1.1, 1.05 * 1.1])
    assert trial.peak_rss_bytes == 101 * 2**20
    assert trial.methods_s["DeepSpeedZeroOptimizer.reset_cpu_buffers"] == pytest.approx([0.022] * 3)
    assert trial.method_calls["DeepSpeedZeroOptimizer.step"] == 1


def test_ratios_are_taken_round_by_round_and_the_record_survives_json(tmp_path):
    study = _study(tmp_path)
    again = fixcost.Study.from_json(json.loads(json.dumps(study.to_json())))
    assert json.dumps(again.to_json()) == json.dumps(study.to_json()) and again.builds == study.builds
    cell = again.cells[0]
    assert [round(r, 6) for r in cell.ratios(fixcost.FIXES)] == [1.05, 1.05]
    assert [round(r, 6) for r in cell.ratios(fixcost.CONTROL)] == [0.98, 0.98]
    assert fixcost_report.same_losses(cell, fixcost.FIXES)  # NaN against NaN counts as the same loss
    assert fixcost_report.same_collectives(cell, fixcost.FIXES)
    cell.of(fixcost.FIXES)[1].losses[0][2] = 3.5
    assert not fixcost_report.same_losses(cell, fixcost.FIXES)


def test_page_shows_the_ratios_rounds_and_method_times(tmp_path):
    page = fixcost_report.render(_study(tmp_path))
    assert "| z2-opt-cpu | 1,650 | 1.050 (1.05–1.05) | 0.980 (0.98–0.98) |" in page
    assert "| 2 | f, a′, a | 1.0–2.0 |" in page
    assert "| `DeepSpeedZeroOptimizer.reset_cpu_buffers` | 1 | 11.00 | 22.00 | 11.00 |" in page
    assert "identical" in page and "nice -10" in page
    results = fixcost_report.RESULTS
    assert fixcost_report.analysis_of(results /
                                      "benchmarks-fixcost-0.19.8.md") == results / "fixcost-analysis-0.19.8.md"
    assert fixcost_report.analysis_of(tmp_path / "benchmarks-fixcost-0.19.8.md") is None
