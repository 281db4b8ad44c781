"""pytest plugin for ``ds_series.upstream_tests``: a flushed, line-per-event log of each test's outcome.

Upstream's harness ends the whole pytest session when a test hangs (``pytest.exit("Test hanged")``) and can then
block forever closing the hung rank pool, so a JUnit XML written at session end may never come, or come without
the tests that ran before the hang. This plugin writes every event as one JSON line as it happens, so the runner
can watch progress, kill a hung session, name the test that hung and resume after it; ``--upstream-tests-done``
deselects the tests an earlier session already finished.

Loaded with ``-p ds_series.upstream_tests_plugin`` (this package installed in the side's virtualenv); the log file is
``$DS_UPSTREAM_TESTS_LOG``. Standard library and pytest only: it runs inside the virtualenv under test.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

#: Environment variable naming the JSON-lines file to append events to.
LOG_ENV = "DS_UPSTREAM_TESTS_LOG"
#: Environment variable naming modules (comma-separated) for the harness's forkserver to import once.
PRELOAD_ENV = "DS_UPSTREAM_TESTS_PRELOAD"
#: The most characters of a failure's text kept in the log (the report quotes the last lines).
LONGREPR_CHARS = 6000


class _EventLog:
    """Appends one JSON object per line and flushes it at once: a killed session loses nothing it reported."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", encoding="utf-8")

    def write(self, **event: Any) -> None:
        event["t"] = time.time()
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()


_log: _EventLog | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--upstream-tests-done", default=None, metavar="FILE",
                     help="deselect the test ids listed in FILE (one per line): finished by an earlier session")
    parser.addoption("--upstream-tests-keep", default=None, metavar="FILE",
                     help="with --upstream-tests-one-per-function: keep exactly the test ids listed in FILE (and what "
                     "is kept whole) instead of the first parametrization of each function")
    parser.addoption("--upstream-tests-only", default=None, metavar="FILE",
                     help="run only the test ids listed in FILE (one per line): a rerun of some tests of a session")
    parser.addoption("--upstream-tests-one-per-function", default=None, metavar="FILE",
                     help="keep one parametrization (the first collected) of each test function, except those whose "
                     "id without parameters, or whose file, is listed in FILE (kept whole)")


def pytest_configure(config: pytest.Config) -> None:
    global _log
    preload = os.environ.get(PRELOAD_ENV)
    if preload:
        # The harness starts its ranks from a forkserver; with these imported there once, each rank forks with them
        # loaded instead of importing torch and DeepSpeed again (seconds per test, for every test on two cores).
        import multiprocessing

        multiprocessing.set_forkserver_preload(["__main__", *preload.split(",")])
    path = os.environ.get(LOG_ENV)
    if path:
        _log = _EventLog(Path(path))
        _log.write(event="session", pid=os.getpid())


@pytest.hookimpl(trylast=True)  # after pytest's own -m/-k deselection (upstream's pytest.ini has -m)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    whole_file = config.getoption("--upstream-tests-one-per-function")
    if whole_file:
        # First, so that a resumed session makes the same choice as the first one.
        whole = set(Path(whole_file).read_text(encoding="utf-8").splitlines())
        keep_file = config.getoption("--upstream-tests-keep")
        listed = set(Path(keep_file).read_text(encoding="utf-8").splitlines()) if keep_file else None
        seen: set[str] = set()

        def wanted(item: pytest.Item) -> bool:
            function = item.nodeid.split("[", 1)[0]
            first = function not in seen if listed is None else item.nodeid in listed
            seen.add(function)
            return first or function in whole or item.nodeid.split("::", 1)[0] in whole

        _deselect(config, items, wanted)
    only_file = config.getoption("--upstream-tests-only")
    if only_file:
        only = set(Path(only_file).read_text(encoding="utf-8").splitlines())
        _deselect(config, items, lambda item: item.nodeid in only)
    done_file = config.getoption("--upstream-tests-done")
    if done_file:
        done = set(Path(done_file).read_text(encoding="utf-8").splitlines())
        _deselect(config, items, lambda item: item.nodeid not in done)
    if _log is not None:
        _log.write(event="collected", nodeids=[item.nodeid for item in items])


def _deselect(config: pytest.Config, items: list[pytest.Item], keep: Any) -> None:
    kept, dropped = [], []
    for item in items:
        (kept if keep(item) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if _log is not None and report.failed:
        _log.write(event="collect_error", nodeid=report.nodeid, longrepr=_text(report.longrepr))


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if _log is not None:
        _log.write(event="start", nodeid=nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _log is None:
        return
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    event: dict[str, Any] = dict(event="report", nodeid=report.nodeid, when=report.when, outcome=outcome,
                                 duration=report.duration)
    if report.failed or report.skipped:
        event["longrepr"] = _text(report.longrepr)
    _log.write(**event)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if _log is not None:
        _log.write(event="finish", nodeid=nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _log is not None:
        _log.write(event="sessionfinish", exitstatus=int(exitstatus))


def _text(longrepr: Any) -> str:
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, reason)
        return str(longrepr[2])
    text = str(longrepr)
    return text if len(text) <= LONGREPR_CHARS else "...\n" + text[-LONGREPR_CHARS:]
