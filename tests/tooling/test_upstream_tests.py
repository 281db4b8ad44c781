"""Tests of tools/upstream_tests.py's rules (tooling, PR 0): the verdict per test id, one outcome from pytest's
phase reports, which changed test functions the CI subset keeps whole, and the plugin's one-per-function
selection. Nothing is installed and no DeepSpeed test runs here; the comparison itself is run on demand and by CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import upstream_tests as ut  # noqa: E402


def _side(name: str, outcomes: dict[str, str], collect_errors: dict[str, str] | None = None) -> ut.Side:
    return ut.Side(name, 0, outcomes=dict(outcomes), collect_errors=dict(collect_errors or {}))


def test_verdicts():
    pristine = _side("pristine", {
        "a.py::regressed": "passed",
        "a.py::upstreams": "failed",
        "a.py::same": "passed",
        "a.py::fixed": "error",
        "a.py::now_skips": "passed",
        "a.py::vanished": "passed",
        "renamed.py::old_name": "passed",
        "broken.py::t": "passed",
    })
    series = _side("series", {
        "a.py::regressed": "failed",
        "a.py::upstreams": "failed",
        "a.py::same": "passed",
        "a.py::fixed": "passed",
        "a.py::now_skips": "skipped",
        "renamed.py::new_name": "passed",
        "new.py::passes": "passed",
        "new.py::hangs": "timeout",
    }, collect_errors={"broken.py": "ImportError"})
    verdicts = ut.compare(pristine, series, changed=["renamed.py", "new.py"])
    assert verdicts == {
        "a.py::regressed": "red",
        "a.py::upstreams": "both-fail",
        "a.py::fixed": "fixed",
        "a.py::now_skips": "changed",
        "a.py::vanished": "red",  # its file is not the series' to change: not collected is a failure
        "renamed.py::old_name": "removed",
        "renamed.py::new_name": "new",
        "new.py::passes": "new",
        "new.py::hangs": "red",
        "broken.py::t": "red",
    }
    assert series.outcomes["a.py::vanished"] == "not collected"


def test_one_outcome_from_phase_reports():
    def report(when, outcome, longrepr=""):
        return {"when": when, "outcome": outcome, "duration": 1.0, "longrepr": longrepr}

    assert ut._combine([report("setup", "passed"), report("call", "passed"), report("teardown", "passed")])[:2] == (
        "passed", "")
    assert ut._combine([report("setup", "failed", "E fixture"), report("teardown", "passed")])[:2] == ("error",
                                                                                                         "E fixture")
    assert ut._combine([report("setup", "skipped", "no GPU"), report("teardown", "passed")])[0] == "skipped"
    assert ut._combine([report("setup", "passed"), report("call", "failed", "E x"), report("teardown",
                                                                                           "passed")])[0] == "failed"
    assert ut._combine([report("setup", "passed"), report("call", "passed"), report("teardown", "failed")])[0] == "error"
    assert ut._combine([report("setup", "passed"), report("call", "xfailed")])[0] == "xfailed"


def test_kept_whole_names_new_files_and_changed_functions(tmp_path: Path):
    upstream, series = tmp_path / "upstream", tmp_path / "series"
    (upstream / "unit").mkdir(parents=True)
    (series / "unit").mkdir(parents=True)
    # One file, two versions: the series changes one method's body and one decorator, and adds a function
    template = textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("stage", [1, 2])
        class TestA:
            def test_same(self, stage):
                assert True

            def test_changed(self, stage):
                with pytest.raises({error}):
                    pass

        def test_plain():
            pass

        @pytest.mark.parametrize("n", {values})
        def test_decorator_changes(n):
            pass
        """)
    (upstream / "unit" / "test_x.py").write_text(template.format(error="AssertionError", values="[1]"))
    (series / "unit" / "test_x.py").write_text(
        template.format(error="ValueError", values="[1, 2]") + "\n\ndef test_added():\n    pass\n")
    (series / "unit" / "test_new.py").write_text("def test_new():\n    pass\n")
    changed = ut.series_changed_files(upstream, series, ("unit", ))
    assert changed == ["unit/test_new.py", "unit/test_x.py"]
    assert ut.kept_whole(upstream, series, changed) == [
        "unit/test_new.py",
        "unit/test_x.py::TestA::test_changed",
        "unit/test_x.py::test_decorator_changes",
        "unit/test_x.py::test_added",
    ]


def test_plugin_keeps_one_parametrization_per_function(tmp_path: Path):
    (tmp_path / "test_p.py").write_text(
        textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("stage", [1, 2, 3])
        def test_dup(stage):
            pass

        @pytest.mark.parametrize("stage", [1, 2])
        def test_whole(stage):
            pass

        @pytest.mark.sequential  # deselected by -m, as upstream's pytest.ini does: never listed as collected
        def test_sequential():
            pass
        """))
    (tmp_path / "whole.txt").write_text("test_p.py::test_whole\n")
    (tmp_path / "done.txt").write_text("test_p.py::test_whole[1]\n")
    events = tmp_path / "events.jsonl"
    result = subprocess.run([
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "upstream_tests_plugin",
        "--upstream-tests-one-per-function=whole.txt", "--upstream-tests-done=done.txt", "-v", "-m",
        "not sequential", "-p", "no:warnings", "test_p.py"
    ], cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "tools"),
                                                          "DS_UPSTREAM_TESTS_LOG": str(events)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed, 4 deselected" in result.stdout
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["nodeids"] for e in lines if e["event"] == "collected"] == [["test_p.py::test_dup[1]",
                                                                           "test_p.py::test_whole[2]"]]
    assert [e["nodeid"] for e in lines if e["event"] == "finish"] == ["test_p.py::test_dup[1]", "test_p.py::test_whole[2]"]


def test_runner_and_plugin_agree_on_names():
    import upstream_tests_plugin as plugin

    assert (ut.PLUGIN, ut.PLUGIN_LOG_ENV, ut.PLUGIN_PRELOAD_ENV) == (plugin.__name__, plugin.LOG_ENV, plugin.PRELOAD_ENV)


def test_plugin_keeps_listed_ids(tmp_path: Path):
    (tmp_path / "test_k.py").write_text(
        textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("stage", [1, 2, 3])
        def test_dup(stage):
            pass

        def test_changed():
            pass

        def test_fails_on_pristine():
            pass
        """))
    (tmp_path / "whole.txt").write_text("test_k.py::test_changed\n")
    (tmp_path / "keep.txt").write_text("test_k.py::test_dup[2]\n")
    result = subprocess.run([
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "upstream_tests_plugin",
        "--upstream-tests-one-per-function=whole.txt", "--upstream-tests-keep=keep.txt", "-v", "-p", "no:warnings",
        "test_k.py"
    ], cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "tools")})
    assert "2 passed, 3 deselected" in result.stdout, result.stdout
    result_lines = [line for line in result.stdout.splitlines() if "PASSED" in line]
    assert [line.split(" ")[0] for line in result_lines] == ["test_k.py::test_dup[2]", "test_k.py::test_changed"]
