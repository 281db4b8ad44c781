"""Tests of ds_series.upstream_tests' rules (tooling): the verdict per test id, one outcome from pytest's
phase reports, which changed test functions the CI subset keeps whole, and the plugin's one-per-function
selection. Nothing is installed and no DeepSpeed test runs here; the comparison itself is run on demand and by CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ds_series import upstream_tests as ut


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
    assert ut._combine([report("setup", "passed"), report("call", "passed"),
                        report("teardown", "failed")])[0] == "error"
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
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "ds_series.upstream_tests_plugin",
        "--upstream-tests-one-per-function=whole.txt", "--upstream-tests-done=done.txt", "-v", "-m",
        "not sequential", "-p", "no:warnings", "test_p.py"
    ], cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "DS_UPSTREAM_TESTS_LOG": str(events)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed, 4 deselected" in result.stdout
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["nodeids"] for e in lines if e["event"] == "collected"] == [["test_p.py::test_dup[1]",
                                                                           "test_p.py::test_whole[2]"]]
    assert [e["nodeid"] for e in lines if e["event"] == "finish"] == ["test_p.py::test_dup[1]",
                                                                      "test_p.py::test_whole[2]"]


def test_runner_and_plugin_agree_on_names():
    from ds_series import upstream_tests_plugin as plugin

    assert (ut.PLUGIN, ut.PLUGIN_LOG_ENV, ut.PLUGIN_PRELOAD_ENV) == (plugin.__name__, plugin.LOG_ENV,
                                                                     plugin.PRELOAD_ENV)


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
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "ds_series.upstream_tests_plugin",
        "--upstream-tests-one-per-function=whole.txt", "--upstream-tests-keep=keep.txt", "-v", "-p", "no:warnings",
        "test_k.py"
    ], cwd=tmp_path, capture_output=True, text=True, env=os.environ)
    assert "2 passed, 3 deselected" in result.stdout, result.stdout
    result_lines = [line for line in result.stdout.splitlines() if "PASSED" in line]
    assert [line.split(" ")[0] for line in result_lines] == ["test_k.py::test_dup[2]", "test_k.py::test_changed"]


def test_compare_with_pristine_run_only_on_the_series_failures():
    # --pristine on-failure: pristine ran only what failed on the series; everything else passed there before.
    pristine = ut.Side("pristine", 0, partial=True,
                       outcomes={"a.py::regressed": "passed", "a.py::upstreams": "failed"})
    series = _side("series", {
        "a.py::regressed": "failed",
        "a.py::upstreams": "failed",
        "a.py::same": "passed",
        "a.py::cut": ut.NOT_RUN,
        "new.py::passes": "passed",
        "new.py::fails": "failed",
    })
    verdicts = ut.compare(pristine, series, changed=["new.py"], pristine_files={"a.py"})
    assert verdicts == {
        "a.py::regressed": "red",
        "a.py::upstreams": "both-fail",
        "a.py::cut": "not-run",
        "new.py::passes": "new",
        "new.py::fails": "red",
    }


def test_python_option_keeps_the_virtualenv(tmp_path: Path):
    # A virtualenv's bin/python links to the interpreter it was made from: the tool must install into the
    # virtualenv, not into that interpreter (CI installed DeepSpeed and an unpinned torch into the system Python).
    interpreter = tmp_path / "system" / "bin" / "python3"
    interpreter.parent.mkdir(parents=True)
    interpreter.symlink_to(sys.executable)
    venv_python = tmp_path / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(interpreter)
    assert ut.venv_of(str(venv_python)) == tmp_path / "venv"


@pytest.mark.parametrize("options", [["--pristine", "on-failure"], ["--python", sys.executable]])
def test_series_installed_needs_the_virtualenv_and_pristine_after_the_series(options, capsys):
    """--series-installed tests the series already installed; pristine run first ("always") would replace it."""
    with pytest.raises(SystemExit) as raised:
        ut.main(["--base", "0.19.8", "--subset", "ci", "--series-installed", *options])
    assert raised.value.code == 2 and "--series-installed needs --python" in capsys.readouterr().err


def test_refuses_a_python_outside_a_virtualenv():
    base_python = Path(sys.base_prefix) / "bin" / "python3"
    if sys.prefix == sys.base_prefix or not base_python.exists():
        pytest.skip("the tests do not run in a virtualenv here")
    ut.require_virtualenv(Path(sys.executable))
    with pytest.raises(SystemExit, match="not the Python of a virtualenv"):
        ut.require_virtualenv(base_python)


def test_run_side_stops_at_the_time_limit_and_reruns_only_listed_ids(tmp_path: Path):
    tests = tmp_path / "side" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_t.py").write_text(
        textwrap.dedent("""
        import time

        def test_quick():
            pass

        def test_fails():
            assert False

        def test_slow():
            time.sleep(60)

        def test_after():
            pass
        """))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ops")}
    side = ut.Side("series", 1)
    ut.run_side(Path(sys.executable), tmp_path / "side", ["test_t.py"], env, timeout=120, side=side,
                deadline=time.monotonic() + 15)
    assert side.outcomes == {
        "test_t.py::test_quick": "passed",
        "test_t.py::test_fails": "failed",
        "test_t.py::test_slow": ut.NOT_RUN,
        "test_t.py::test_after": ut.NOT_RUN,
    }
    rerun = ut.Side("series-rerun", 1)
    ut.run_side(Path(sys.executable), tmp_path / "side", ["test_t.py"], env, timeout=120, side=rerun,
                only=["test_t.py::test_fails", "test_t.py::test_after"])
    assert rerun.outcomes == {"test_t.py::test_fails": "failed", "test_t.py::test_after": "passed"}


def test_a_terminated_runner_kills_its_pytest_session(tmp_path: Path):
    # CI stops a comparison that runs out of time with SIGTERM; the pytest session runs in a session of its own, so
    # the runner must kill it, or its ranks keep the CPUs busy for the rest of CI.
    tests = tmp_path / "side" / "tests"
    tests.mkdir(parents=True)
    pid_file = tmp_path / "pid"
    (tests / "test_s.py").write_text(
        textwrap.dedent(f"""
        import os
        import time
        from pathlib import Path

        def test_sleeps():
            Path({str(pid_file)!r}).write_text(str(os.getpid()))
            time.sleep(120)
        """))
    runner = textwrap.dedent(f"""
        import signal, sys, time
        from pathlib import Path
        from ds_series import upstream_tests as ut
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        env = dict(__import__("os").environ, TORCH_EXTENSIONS_DIR={str(tmp_path)!r})
        ut.run_side(Path(sys.executable), Path({str(tmp_path / "side")!r}), ["test_s.py"], env, 300, ut.Side("s", 1))
        """)
    proc = subprocess.Popen([sys.executable, "-c", runner])
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pid_file.exists(), "the test never started"
    test_pid = int(pid_file.read_text())
    proc.terminate()
    assert proc.wait(timeout=30) == 143
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(test_pid, 0)
            time.sleep(0.1)


def test_harness_gets_8397_and_the_failed_check_fix_once(tmp_path: Path):
    """Upstream's harness at v0.19.3 gets upstream's #8397 (a backport below the 0.19.8 series) and that series'
    ``fix-cpu-test-harness``; a harness that has both is left as it is."""
    common = tmp_path / "tests" / "unit" / "common.py"
    common.parent.mkdir(parents=True)
    upstream = ut.ROOT.parent / "shared" / "upstream-0.19.3" / "tests" / "unit" / "common.py"
    if not upstream.is_file():
        pytest.skip(f"{upstream} is not on this machine")
    common.write_bytes(upstream.read_bytes())
    assert ut.fix_harness(tmp_path / "tests").count(" applied") == 2
    text = common.read_text()
    assert "tensor_flag = torch.tensor([1 if flag else 0]" in text and "isinstance(e, Failed)" in text
    assert ut.fix_harness(tmp_path / "tests") == "already fixed"
