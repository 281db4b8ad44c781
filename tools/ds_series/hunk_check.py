#!/usr/bin/env python3
"""Hunk-removal check: which production hunks of a series does no test of their PR notice?

For each PR of a base's series, the check drops one production hunk (a hunk of the PR's diff in ``deepspeed/``;
test and doc hunks are not checked) at a time from the tree as of that PR, runs that PR's tests, and records
the first test that fails, or that none does. A hunk no test notices is a test that is missing, or a hunk that
can go. Run on demand (not in CI); it writes a Markdown report (default ``tools/results/hunk-check-<base>.md``).

What it checks is a snapshot of committed work: ``git archive <rev>`` of this repository (default HEAD) into
``build/hunk-check/<base>/main-<commit>/``, whose ``tools/ds_series/stack.py materialize`` builds the series' tree
there (never ``deepspeed-src/``). Uncommitted edits to patches/ or tests/ are not seen.

A PR's tests: the project's tests that belong to it (``@pytest.mark.pr``, as ``conftest.py`` resolves the marker
for the base), at world size 2 on the core engine configurations (``--paths core``), without the Tinker server's
and the tooling tests (as CI's prefix runs); and, where the PR's patch adds or changes test files under
``tests/unit/`` (0.19.8's in-tree ``DistributedTest`` files), those files, run the way ``.ci/run`` runs them: from a
copy of the tree's ``tests/`` folder, so the installed DeepSpeed is imported.

Nothing is reinstalled per hunk. The virtualenv (``--venv``) holds the base's whole series, installed
non-editable, with its JIT-built ops (``$TORCH_EXTENSIONS_DIR``, default ``<venv>/torch_extensions``); create it
with ``DS_SERIES_VENV=<venv> DS_SERIES_BASE=<base> CXX=$PWD/.ci/bin/g++ bash tools/test.sh --install-only``. For PR K
the check writes the ``deepspeed/`` Python files as of PR K into that virtualenv's site-packages (DeepSpeed's
version string stays the whole series', which the tests only read for the base), runs PR K's tests once unchanged
(the baseline: tests that fail or skip there are left out and reported), then, per hunk, reverses just that hunk
in its file, runs the tests with ``-x`` in the order most likely to fail first, and restores the file. At the end
the installed files are restored.

Outcomes per hunk: ``noticed by <test id>``; ``noticed (hang)`` when a test or the whole run timed out;
``noticed (import error)`` when the file without the hunk does not compile or import (weak evidence: reported
apart); ``NOT NOTICED``. Results are kept in ``build/hunk-check/<base>/results-<commit>.json``: a rerun on the
same commit reuses them (``--fresh`` discards them).

Usage (from the repository root; run it with ``nice``, it keeps two cores busy for an hour or more):

    .venv/bin/python -m ds_series.hunk_check --base 0.19.3 --venv .venv-hunks-0.19.3
    .venv/bin/python -m ds_series.hunk_check --base 0.19.8 --venv .venv-hunks-0.19.8 --prs gradient-divide-factor

As a pytest plugin (``-p ds_series.hunk_check``, in a virtualenv where this package is installed) the module records
outcomes for the check: ``$HUNK_CHECK_COLLECT`` gets each collected test's PR, ``$HUNK_CHECK_REPORT`` each test's
outcome.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ds_series import stack
from local_ranks.procs import clean_shm, descendants, kill_tree, shm_files

ROOT = Path(__file__).resolve().parents[2]
WORK_ROOT = ROOT / "build" / "hunk-check"
#: The tests CI's prefix runs leave out: they do not depend on the installed prefix (tooling), or are slow
#: end-to-end runs of the Tinker server that other tests of the same PR cover.
IGNORED_TEST_PATHS = ("tests/tinker_server", "tests/tooling")
#: Files DeepSpeed's setup.py writes at install time: not the series'.
BUILD_OUTPUTS = {"deepspeed/git_version_info_installed.py"}
GIT = ["git", "-c", "diff.algorithm=myers", "-c", "core.abbrev=12", "-c", "core.quotepath=false"]
GIT_ENV = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
#: Failure messages that may mean the file without the hunk does not even import.
IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError", "SyntaxError", "IndentationError", "NameError")

try:
    import pytest

    _trylast = pytest.hookimpl(trylast=True)
except ImportError:  # the CLI side needs no pytest

    def _trylast(function):
        return function


# --------------------------------------------------------------------------------------------
# pytest plugin side (loaded with -p hunk_check in the test runs)
# --------------------------------------------------------------------------------------------


def _append_json(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


_ROOTDIR = ""


def pytest_configure(config) -> None:
    global _ROOTDIR
    _ROOTDIR = str(config.rootpath)


@_trylast  # after conftest.py's selection (--paths, --world-sizes)
def pytest_collection_modifyitems(session, config, items) -> None:
    path = os.environ.get("HUNK_CHECK_COLLECT")
    if not path:
        return
    conftest = next(
        (p for p in config.pluginmanager.get_plugins()
         if hasattr(p, "pr_name_of") and str(getattr(p, "__file__", "")).endswith(os.path.join("tests", "conftest.py"))
         ), None)
    for item in items:
        pr = conftest.pr_name_of(item) if conftest is not None else None
        _append_json(path, {"nodeid": item.nodeid, "pr": pr, "skip": item.get_closest_marker("skip") is not None})


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("HUNK_CHECK_REPORT")
    if not path:
        return
    if report.when != "call" and report.outcome == "passed":
        return
    message = ""
    if report.outcome == "failed":
        text = report.longreprtext or ""
        lines = [line for line in text.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("E ")]
        message = "\n".join((errors or lines)[-12:])
    _append_json(
        path, {
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "duration": report.duration,
            "message": message[-3000:],
            "rootdir": _ROOTDIR
        })


def pytest_collectreport(report) -> None:
    path = os.environ.get("HUNK_CHECK_REPORT")
    if path and report.failed:
        _append_json(
            path, {
                "nodeid": report.nodeid or "<collection>",
                "when": "collect",
                "outcome": "failed",
                "duration": 0.0,
                "message": (report.longreprtext or "")[-3000:]
            })


# --------------------------------------------------------------------------------------------
# Hunks
# --------------------------------------------------------------------------------------------


@dataclass
class Hunk:
    """One hunk of a PR's diff of one file: the new file's lines ``new_start .. new_start + new_len - 1`` came
    from the old side's ``old_lines``."""

    pr: str
    file: str
    index: int  # 1-based, within the file's diff
    header: str  # the @@ line
    new_start: int
    new_len: int
    old_lines: list[str]
    body: list[str]  # the hunk's lines with their ' ', '-', '+' prefix

    @property
    def key(self) -> str:
        digest = hashlib.sha256("\n".join(self.body).encode()).hexdigest()[:16]
        return f"{self.pr}:{self.file}:{self.index}:{digest}"

    def first_changes(self, count: int = 3) -> list[str]:
        """The first ``count`` removed and the first ``count`` added lines (blank ones skipped), in diff order."""
        removed = [i for i, line in enumerate(self.body) if line[:1] == "-" and line[1:].strip()][:count]
        added = [i for i, line in enumerate(self.body) if line[:1] == "+" and line[1:].strip()][:count]
        return [self.body[i] for i in sorted(removed + added)]

    def code_changed(self, new_text: str | None) -> bool:
        """Whether undoing the hunk changes the file's code, not only its comments and docstrings."""
        try:
            return _code(new_text) != _code(self.reverse(new_text))
        except SyntaxError:
            return True

    def line_range(self) -> str:
        if self.new_len == 0:
            return f"removes lines before new line {self.new_start + 1}"
        return f"new lines {self.new_start}-{self.new_start + self.new_len - 1}"

    def reverse(self, new_text: str | None) -> str | None:
        """The file as of the PR with only this hunk undone (None: the hunk creates the file)."""
        old_is_empty = self.header.startswith("@@ -0,0 ")
        if new_text is None:
            raise ValueError("hunk of a deleted file")
        lines = new_text.splitlines(keepends=True)
        start = self.new_start - 1 if self.new_len else self.new_start
        if old_is_empty and start <= 0 and self.new_len == len(lines):
            return None
        return "".join(lines[:start] + self.old_lines + lines[start + self.new_len:])


def _code(text: str | None) -> str:
    """A file's syntax tree without docstrings (comments are not in it), as text."""
    if text is None:
        return ""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_diff(pr: str, diff: str) -> list[Hunk]:
    hunks: list[Hunk] = []
    file = None
    current: Hunk | None = None
    lines = diff.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("diff --git "):
            file, current = None, None
            continue
        if line.startswith("+++ "):
            target = line[4:].rstrip("\n")
            file = target[2:] if target.startswith("b/") else None
            if file is None:  # deleted file: take the name from ---
                previous = lines[i - 1][4:].rstrip("\n")
                file = previous[2:]
            continue
        if line.startswith("--- ") and current is None:
            continue
        m = _HUNK_RE.match(line)
        if m and file is not None:
            new_start = int(m.group(3))
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            index = sum(1 for h in hunks if h.file == file) + 1
            current = Hunk(pr, file, index, line.rstrip("\n"), new_start, new_len, [], [])
            hunks.append(current)
            continue
        if current is None:
            continue
        if line.startswith("\\"):  # "\ No newline at end of file", about the line before
            if current.body and current.body[-1][:1] in " -" and current.old_lines:
                current.old_lines[-1] = current.old_lines[-1].rstrip("\n")
            continue
        tag, text = line[:1], line[1:]
        if tag in (" ", "-"):
            current.old_lines.append(text)
        if tag in (" ", "-", "+"):
            current.body.append(line.rstrip("\n"))
    return hunks


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[hunk_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def tool_script(src: Path, name: str) -> Path:
    """The tool ``name`` (``stack.py``, ``build_ops.py``) of the checkout ``src``: in ``tools/ds_series/``, or in
    ``tools/`` in a commit from before the tools became a package."""
    for folder in ("tools/ds_series", "tools"):
        if (src / folder / name).is_file():
            return src / folder / name
    raise SystemExit(f"error: {src} has no tools/ds_series/{name} (nor tools/{name})")


def run(argv: list[str], cwd: Path | None = None, env: dict | None = None, check: bool = True) -> str:
    result = subprocess.run(argv, cwd=cwd, env=env, text=True, capture_output=True)
    if check and result.returncode != 0:
        raise SystemExit(f"error: {' '.join(map(str, argv))} failed in {cwd}:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def git(repo: Path, *args: str) -> str:
    return run([*GIT, *args], cwd=repo, env={**os.environ, **GIT_ENV})


def run_with_timeout(argv: list[str], cwd: Path, env: dict, timeout: float,
                     log_path: Path) -> tuple[int | None, float]:
    """Run a test command; on timeout interrupt it (pytest then shuts its rank pools down), then kill it and
    every process it started. Returns (exit code or None on timeout, seconds)."""
    start = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(argv,
                                cwd=cwd,
                                env=env,
                                stdout=out,
                                stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=_default_sigint)
        try:
            return proc.wait(timeout=timeout), time.monotonic() - start
        except subprocess.TimeoutExpired:
            _stop(proc, grace=30)
        except BaseException:  # the check itself was interrupted: take the run down with it
            _stop(proc, grace=5)
            raise
        return None, time.monotonic() - start


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """Interrupt a run, then kill it and every process it started (ranks run in sessions of their own)."""
    family = descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    family += descendants(proc.pid)
    for pid in [proc.pid, *family]:
        kill_tree(pid)
    proc.wait()


def _default_sigint() -> None:
    """In the child: SIGINT interrupts (a job started in the background inherits it ignored), so that a test run
    that timed out shuts its rank pools down."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(signum, frame) -> None:  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


# --------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------


@dataclass
class Suite:
    """One pytest invocation's worth of a PR's tests: where it runs and the node ids, in run order."""

    name: str  # "project", "earlier" or "in-tree-<file>"
    cwd: Path
    env: dict
    args: list[str]
    tests: list[str]
    durations: dict[str, float] = field(default_factory=dict)
    baseline_seconds: float = 0.0


@dataclass
class Result:
    key: str
    pr: str
    file: str
    index: int
    header: str
    lines: str
    changes: list[str]
    outcome: str  # noticed | hang | import-error | not-noticed | no-tests | comments-only
    test: str = ""
    message: str = ""
    seconds: float = 0.0


class Checker:

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = args.base
        self.venv = Path(args.venv).resolve()
        self.python = self.venv / "bin" / "python"
        if not self.python.exists():
            raise SystemExit(f"error: {self.python} does not exist; create the virtualenv first (see --help)")
        self.commit = git(ROOT, "rev-parse", args.rev).strip()
        self.work = WORK_ROOT / self.base
        self.src = self.work / f"main-{self.commit[:12]}"
        self.tree = self.src / "deepspeed-src" / self.base
        self.results_path = self.work / f"results-{self.commit[:12]}.json"
        self.logs = self.work / "logs"
        self.report_path = (Path(args.report) if args.report
                            else ROOT / "tools" / "results" / f"hunk-check-{self.base}.md")
        self.results: dict[str, dict] = {}
        self.hunk_counts: dict[str, int] = {}
        self.baselines: dict[str, dict] = {}
        self.started = time.time()
        self.env = self._test_env()

    # ----- set-up -----

    def _test_env(self) -> dict:
        env = {**os.environ}
        env["DS_SERIES_BASE"] = self.base
        env["DS_SERIES_CHECKOUT"] = str(self.src)  # the installed stack tool reads that commit's series, not ours
        env["TORCH_EXTENSIONS_DIR"] = os.environ.get("TORCH_EXTENSIONS_DIR") or str(self.venv / "torch_extensions")
        cxx = ROOT / ".ci" / "bin" / "g++"
        if "CXX" not in os.environ and cxx.exists() and shutil.which("g++"):
            env["CXX"] = str(cxx)  # the build command the ops were built with, so that none rebuilds
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # the patched files change within a second; no stale .pyc
        # PATH stays as it is: tools/test.sh built the ops with the ninja found there, and another ninja (the
        # virtualenv's pip-installed one) reads its log as missing and rebuilds every op.
        env["VIRTUAL_ENV"] = str(self.venv)
        env.pop("DS_SERIES_UPTO", None)
        return env

    def snapshot(self) -> None:
        """``git archive`` of the checked commit, and the series materialized from it (reused if present)."""
        if (self.tree / ".git").exists():
            log(f"reusing {self.tree.relative_to(ROOT)}")
            return
        if self.src.exists():
            shutil.rmtree(self.src)
        self.src.mkdir(parents=True)
        archive = subprocess.run([*GIT, "archive", "--format=tar", self.commit],
                                 cwd=ROOT,
                                 stdout=subprocess.PIPE,
                                 env={
                                     **os.environ,
                                     **GIT_ENV
                                 },
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(self.src)], input=archive, check=True)
        env = {**os.environ}
        base_toml = self.src / "patches" / f"deepspeed-{self.base}" / "base.toml"
        extras = tomllib.loads(base_toml.read_text()).get("extras")
        if extras and not env.get("DS_SERIES_UPSTREAM_FILES"):
            env["DS_SERIES_UPSTREAM_FILES"] = str((ROOT / extras["source"]).resolve())
        log(f"materializing the {self.base} series of main {self.commit[:12]} in {self.tree.relative_to(ROOT)}")
        # That commit's own stack tool, run as a script (standard library only; it finds patches/ beside it).
        script = tool_script(self.src, "stack.py")
        run([sys.executable, str(script), "--base", self.base, "materialize"], cwd=self.src, env=env)

    def series(self) -> list[str]:
        names = []
        for line in (self.src / "patches" / f"deepspeed-{self.base}" / "series").read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                names.append(line.split()[0])
        return names

    def site_deepspeed(self) -> Path:
        out = run([str(self.python), "-c", "import importlib.util as u; print(u.find_spec('deepspeed').origin)"],
                  cwd=Path("/tmp"),
                  env=self.env).strip().splitlines()[-1]
        package = Path(out).parent
        if "site-packages" not in package.parts:
            raise SystemExit(f"error: {self.venv}'s deepspeed is {package}, not an installed (non-editable) copy")
        version = run([str(self.python), "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"],
                      cwd=Path("/tmp"),
                      env=self.env).strip()
        if version.split("+")[0] != self.base:
            raise SystemExit(f"error: {self.venv} has deepspeed {version}, not a {self.base} build")
        self.installed_version = version
        return package

    # ----- the tree as of a PR -----

    def tree_files(self, rev: str) -> dict[str, bytes]:
        names = git(self.tree, "ls-tree", "-r", "--name-only", rev, "--", "deepspeed").split("\n")
        return {n: self._show(rev, n) for n in names if n.endswith(".py") and n not in BUILD_OUTPUTS}

    def _show(self, rev: str, path: str) -> bytes:
        return subprocess.run([*GIT, "show", f"{rev}:{path}"],
                              cwd=self.tree,
                              stdout=subprocess.PIPE,
                              check=True,
                              env={
                                  **os.environ,
                                  **GIT_ENV
                              }).stdout

    def managed_files(self) -> set[str]:
        """The deepspeed/*.py files the check writes: every file a PR touches, and any installed file that differs
        from the series' tip (a virtualenv built from other patches)."""
        touched = set(f for f in git(self.tree, "diff", "--name-only", "upstream", "HEAD", "--", "deepspeed").split()
                      if f.endswith(".py") and f not in BUILD_OUTPUTS)
        tip = self.tree_files("HEAD")
        differ = set()
        for name, data in tip.items():
            installed = self.site.parent / name
            if not installed.exists() or installed.read_bytes() != data:
                differ.add(name)
        if differ - touched:
            log(f"warning: the virtualenv's deepspeed differs from the checked series in {sorted(differ - touched)}; "
                "the check writes the series' version of those files too")
        return touched | differ

    def write_files(self, files: dict[str, bytes | None]) -> None:
        for name, data in files.items():
            path = self.site.parent / name
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                if not path.exists() or path.read_bytes() != data:
                    path.write_bytes(data)
            cache = path.parent / "__pycache__"
            for pyc in cache.glob(path.stem + ".*.pyc") if cache.is_dir() else []:
                pyc.unlink(missing_ok=True)

    def state_at(self, rev: str) -> dict[str, bytes | None]:
        files = self.tree_files(rev)
        return {name: files.get(name) for name in self.managed}

    # ----- tests -----

    def collect_project(self) -> dict[str, list[str]]:
        """Node ids of the project's tests, by the PR conftest.py gives them (at --paths core, world size 2)."""
        out = self.logs / "collect.jsonl"
        out.unlink(missing_ok=True)
        argv = [
            str(self.python), "-m", "pytest", "-p", "no:cacheprovider", "-p", "ds_series.hunk_check", "--collect-only",
            "-q", "--paths", "core", "--world-sizes", "2", *(f"--ignore={p}" for p in self.args.ignore), "tests"
        ]
        rc, _ = run_with_timeout(argv, self.src, {
            **self.env, "HUNK_CHECK_COLLECT": str(out)
        }, 600, self.logs / "collect.log")
        if rc != 0 or not out.exists():
            raise SystemExit(f"error: collecting the project's tests failed; see {self.logs / 'collect.log'}")
        by_pr: dict[str, list[str]] = {}
        for line in out.read_text().splitlines():
            record = json.loads(line)
            if record["pr"] and not record["skip"]:
                by_pr.setdefault(record["pr"], []).append(record["nodeid"])
        return by_pr

    def suites_for(self, pr: str, rev: str) -> list[Suite]:
        suites = []
        project = self.project_tests.get(pr, [])
        if project:
            args = ["--paths", "core", "--world-sizes", "2", "--rank-timeout", str(self.args.rank_timeout)]
            suites.append(Suite("project", self.src, self.env, args, list(project)))
        parent = f"{rev}~1"
        changed = git(self.tree, "diff", "--name-only", parent, rev, "--", "tests/unit").split()
        files = [f for f in changed if Path(f).name.startswith("test_") and f.endswith(".py") and self._exists(rev, f)]
        if files:
            copy = self.work / f"in-tree-{pr}"
            if copy.exists():
                shutil.rmtree(copy)
            copy.mkdir(parents=True)
            archive = subprocess.run([*GIT, "archive", "--format=tar", rev, "tests"],
                                     cwd=self.tree,
                                     check=True,
                                     stdout=subprocess.PIPE,
                                     env={
                                         **os.environ,
                                         **GIT_ENV
                                     }).stdout
            subprocess.run(["tar", "-x", "-C", str(copy)], input=archive, check=True)
            env = {
                **self.env, "DS_ACCELERATOR": "cpu",
                "LOCAL_SIZE": "2",
                "DS_UNITTEST_TIMEOUT": str(int(self.args.rank_timeout))
            }
            # One run per file: upstream's harness ends the whole pytest session when one test hangs
            # (DS_UNITTEST_TIMEOUT), which would leave the other files unrun.
            for file in files:
                suites.append(Suite(f"in-tree-{Path(file).stem}", copy, env, [], [file]))
        return suites

    def _exists(self, rev: str, path: str) -> bool:
        return subprocess.run([*GIT, "cat-file", "-e", f"{rev}:{path}"], cwd=self.tree, env={
            **os.environ,
            **GIT_ENV
        }).returncode == 0

    def run_suite(self, suite: Suite, tests: list[str], tag: str, stop_first: bool,
                  timeout: float) -> tuple[list[dict], int | None, float]:
        report = self.logs / f"{tag}.jsonl"
        report.unlink(missing_ok=True)
        argv = [
            str(self.python), "-m", "pytest", "-p", "no:cacheprovider", "-p", "ds_series.hunk_check", "-q", "-rN",
            *(["-x"] if stop_first else []), *suite.args, *tests
        ]
        before = shm_files()
        self._clear_stale_locks()
        self._restore_ninja_state()
        rc, seconds = run_with_timeout(argv, suite.cwd, {
            **suite.env, "HUNK_CHECK_REPORT": str(report)
        }, timeout, self.logs / f"{tag}.log")
        clean_shm(before)
        records = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
        for r in records:  # node ids relative to this suite's folder, to name them on a later command line
            if r.get("rootdir") and r["when"] != "collect":
                path, sep, rest = r["nodeid"].partition("::")
                r["nodeid"] = os.path.relpath(Path(r["rootdir"]) / path, suite.cwd) + sep + rest
        return records, rc, seconds

    def _clear_stale_locks(self) -> None:
        """A build killed mid-way leaves ``<op>/lock`` behind and later loads wait on it forever. The extensions
        folder is this virtualenv's own; between our runs nothing builds in it."""
        folder = Path(self.env["TORCH_EXTENSIONS_DIR"])
        for lock in folder.glob("*/lock") if folder.is_dir() else []:
            log(f"removing stale {lock}")
            lock.unlink(missing_ok=True)

    # ----- per PR -----

    def baseline(self, pr: str, suites: list[Suite], key: str | None = None) -> None:
        summary = {"tests": 0, "failed": [], "skipped": 0, "seconds": 0.0}
        for suite in suites:
            timeout = self.args.baseline_timeout
            records, rc, seconds = self.run_suite(suite, suite.tests, f"{pr}-baseline-{suite.name}", False, timeout)
            outcomes: dict[str, str] = {}
            for r in records:
                if r["when"] == "collect":
                    summary["failed"].append(f"{r['nodeid']} (collection)")
                    continue
                if r["outcome"] != "passed" or r["when"] == "call":
                    outcomes[r["nodeid"]] = r["outcome"] if outcomes.get(r["nodeid"]) != "failed" else "failed"
                if r["when"] == "call":
                    suite.durations[r["nodeid"]] = r["duration"]
            passed = [t for t, o in outcomes.items() if o == "passed"]
            failed = [t for t, o in outcomes.items() if o == "failed"]
            skipped = [t for t, o in outcomes.items() if o == "skipped"]
            if rc is None:
                summary["failed"].append(f"{suite.name} suite timed out after {seconds:.0f} s")
            summary["tests"] += len(passed)
            summary["failed"] += failed
            summary["skipped"] += len(skipped)
            summary["seconds"] += seconds
            suite.baseline_seconds = seconds
            # In-tree suites are named by file; the node ids that passed replace them.
            suite.tests = passed
        self.baselines[key or pr] = summary

    def check_hunk(self, hunk: Hunk, state: dict[str, bytes | None], suites: list[Suite],
                   noticers: list[str]) -> Result:
        result = Result(hunk.key, hunk.pr, hunk.file, hunk.index, hunk.header, hunk.line_range(), hunk.first_changes(),
                        "not-noticed")
        new = state[hunk.file]
        reversed_text = hunk.reverse(new.decode() if new is not None else None)
        data = reversed_text.encode() if reversed_text is not None else None
        if data is not None:
            try:
                compile(data, hunk.file, "exec")
            except SyntaxError as err:
                result.outcome, result.message = "import-error", f"SyntaxError: {err}"
                return result
        start = time.monotonic()
        self.write_files({hunk.file: data})
        try:
            for suite in sorted(suites, key=lambda s: -sum(t in noticers for t in s.tests)):
                if not suite.tests:
                    continue
                order = sorted(suite.tests,
                               key=lambda t: (t not in noticers, noticers.index(t)
                                              if t in noticers else 0, suite.durations.get(t, 1e9)))
                timeout = self.args.timeout_factor * max(suite.baseline_seconds, 30) + 120
                tag = f"{hunk.pr}-{Path(hunk.file).stem}-{hunk.index}-{suite.name}"
                records, rc, seconds = self.run_suite(suite, order, tag, True, timeout)
                failed = [r for r in records if r["outcome"] == "failed"]
                if rc is None:
                    self.write_files({hunk.file: new})
                    self.build_ops()  # a build the kill interrupted, done again now
                    result.outcome = "hang"
                    result.test = failed[0]["nodeid"] if failed else (records[-1]["nodeid"] if records else "")
                    result.message = f"the run was killed after {seconds:.0f} s"
                    break
                if failed:
                    first = failed[0]
                    result.test, result.message = first["nodeid"], first["message"]
                    timed_out = "Timeout" in first["message"] or "timed out" in first["message"]
                    result.outcome = "hang" if timed_out else "noticed"
                    if any(m in first["message"] for m in IMPORT_ERRORS) and self.import_fails(hunk.file):
                        result.outcome = "import-error"
                    break
                if rc not in (0, 5):
                    result.outcome, result.test = "noticed", f"pytest exit {rc} ({suite.name} suite)"
                    result.message = (self.logs / f"{tag}.log").read_text()[-2000:]
                    break
        finally:
            self.write_files({hunk.file: new})
            result.seconds = time.monotonic() - start
        return result

    def import_fails(self, file: str) -> bool:
        module = file[:-3].replace("/", ".").removesuffix(".__init__")
        result = subprocess.run([str(self.python), "-c", f"import deepspeed, {module}"],
                                cwd="/tmp",
                                env={
                                    **self.env, "DS_ACCELERATOR": "cpu"
                                },
                                stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        return result.returncode != 0

    # ----- driver -----

    def load_results(self) -> None:
        if self.results_path.exists() and not self.args.fresh:
            data = json.loads(self.results_path.read_text())
            self.results = data.get("results", {})
            self.baselines = data.get("baselines", {})

    def save_results(self) -> None:
        self.results_path.write_text(json.dumps({"results": self.results, "baselines": self.baselines}, indent=1))

    def originals(self) -> dict[str, bytes | None]:
        """The installed bytes of the files the check writes, kept in ``<work>/site-backup/`` the first time (a run
        killed before it restored them leaves the next run the backup, not the half-checked files), per install."""
        backup = self.work / "site-backup"
        record = next(self.site.parent.glob("deepspeed-*.dist-info/RECORD"), None)
        stamp = f"{self.installed_version} {record.stat().st_mtime_ns if record else 0} {self.venv}"
        index = backup / "index.json"
        saved = json.loads(index.read_text()) if index.exists() else {}
        if saved.get("stamp") != stamp:
            if backup.exists():
                shutil.rmtree(backup)
            saved = {"stamp": stamp, "files": {}}
        for name in self.managed:
            if name not in saved["files"]:
                path = self.site.parent / name
                saved["files"][name] = path.exists()
                if path.exists():
                    (backup / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, backup / name)
        backup.mkdir(parents=True, exist_ok=True)
        index.write_text(json.dumps(saved, indent=1))
        return {name: ((backup / name).read_bytes() if saved["files"][name] else None) for name in self.managed}

    def build_ops(self) -> None:
        """Build (or find built) the JIT ops once, outside the tests' timeouts; a no-op when they are up to date."""
        self._clear_stale_locks()
        rc, seconds = run_with_timeout([str(self.python), str(tool_script(self.src, "build_ops.py"))], Path("/tmp"),
                                       self.env, 3600, self.logs / "build_ops.log")
        if rc != 0:
            raise SystemExit(f"error: building DeepSpeed's ops failed; see {self.logs / 'build_ops.log'}")
        if seconds > 60:
            log(f"built DeepSpeed's JIT ops in {seconds:.0f} s")
        # ninja 1.13 can lose an op's .ninja_log when a rank is killed while it checks the op (a failing test's
        # peers are killed; so is a run that timed out); without it ninja rebuilds the op, minutes inside a test's
        # timeout. Each run starts with the ninja state of this good build.
        backup = self.work / "ops-ninja-state"
        if backup.exists():
            shutil.rmtree(backup)
        for op in sorted(Path(self.env["TORCH_EXTENSIONS_DIR"]).glob("*/build.ninja")):
            for name in (".ninja_log", ".ninja_deps"):
                if (op.parent / name).exists():
                    (backup / op.parent.name).mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(op.parent / name, backup / op.parent.name / name)
                else:
                    log(f"warning: {op.parent / name} is missing after building the ops")

    def _restore_ninja_state(self) -> None:
        backup = self.work / "ops-ninja-state"
        for saved in backup.glob("*/.ninja_*") if backup.is_dir() else []:
            target = Path(self.env["TORCH_EXTENSIONS_DIR"]) / saved.parent.name / saved.name
            if not target.exists() or target.read_bytes() != saved.read_bytes():
                log(f"restoring {target} (lost by a killed rank)")
                shutil.copyfile(saved, target)

    def main(self) -> int:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _interrupt)
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        self.snapshot()
        self.site = self.site_deepspeed()
        self.managed = self.managed_files()
        self.load_results()
        series = self.series()
        wanted = self.args.prs or series
        unknown = [p for p in wanted if p not in series]
        if unknown:
            raise SystemExit(f"error: not in the {self.base} series: {', '.join(unknown)}")
        if self.args.report_only:  # reads the virtualenv, writes nothing into it
            for pr in series:
                self.check_pr(pr)
            self.save_results()
            self.write_report(series)
            log(f"report: {self.report_path}")
            return 0
        original = self.originals()
        self.write_files(original)
        self.build_ops()
        log(f"deepspeed {self.installed_version} in {self.venv}; series of main {self.commit[:12]}: {len(series)} PRs")
        self.project_tests = self.collect_project()
        try:
            for pr in series:
                if pr not in wanted:
                    continue
                self.check_pr(pr)
        finally:
            self.write_files(original)
            self.save_results()
            self.write_report(series)
        log(f"report: {self.report_path}")
        return 0

    def check_pr(self, pr: str) -> None:
        diff = git(self.tree, "diff", "--no-color", "--no-ext-diff", f"-U{self.args.context}", f"{pr}~1", pr, "--",
                   "deepspeed")
        hunks = [h for h in parse_diff(pr, diff) if h.file.endswith(".py")]
        self.hunk_counts[pr] = len(hunks)
        if not hunks:
            log(f"{pr}: no production hunks")
            return
        state = self.state_at(pr)
        comment_only = {h.key: not h.code_changed(_text(state[h.file])) for h in hunks}
        for h in hunks:  # results kept from an earlier run: the report shows the lines as this version cuts them
            if h.key in self.results:
                self.results[h.key]["changes"] = h.first_changes()
                self.results[h.key]["comment_only"] = comment_only[h.key]
        if self.args.report_only:
            return
        todo = [h for h in hunks if h.key not in self.results]
        if not todo:
            log(f"{pr}: all {len(hunks)} hunks done earlier")
            self.check_wider(pr, hunks, state)
            return
        self.write_files(state)
        suites = self.suites_for(pr, pr)
        log(f"{pr}: {len(hunks)} hunk(s), {len(todo)} to check; tests: " + ", ".join(f"{len(s.tests)} {s.name}"
                                                                                     for s in suites))
        self.baseline(pr, suites)
        b = self.baselines[pr]
        log(f"{pr}: baseline {b['tests']} passed, {len(b['failed'])} failed, {b['skipped']} skipped "
            f"in {b['seconds']:.0f} s")
        self.save_results()
        noticers: list[str] = []
        for hunk in todo:
            if comment_only[hunk.key]:  # nothing a test could notice
                result = Result(hunk.key, pr, hunk.file, hunk.index, hunk.header, hunk.line_range(),
                                hunk.first_changes(), "comments-only")
            elif not any(s.tests for s in suites):
                result = Result(hunk.key, pr, hunk.file, hunk.index, hunk.header, hunk.line_range(),
                                hunk.first_changes(), "no-tests")
            else:
                result = self.check_hunk(hunk, state, suites, noticers)
            if result.test and result.outcome in ("noticed", "hang") and result.test not in noticers:
                noticers.insert(0, result.test)
            self.results[hunk.key] = {**asdict(result), "comment_only": comment_only[hunk.key]}
            self.save_results()
            log(f"{pr} {hunk.file} #{hunk.index} ({hunk.line_range()}): {describe(result)} [{result.seconds:.0f} s]")
        self.check_wider(pr, hunks, state)
        self.write_report(self.series())

    def check_wider(self, pr: str, hunks: list[Hunk], state: dict[str, bytes | None]) -> None:
        """With --wider: does a test of an earlier PR of the series notice a hunk that its own PR's tests do not?
        (Then the hunk has a test, marked with another PR; otherwise it has none in the series up to its PR.)"""
        if not self.args.wider:
            return
        flagged = [
            h for h in hunks
            if self.results[h.key]["outcome"] in ("not-noticed", "no-tests") and "wider" not in self.results[h.key]
        ]
        series = self.series()
        earlier = [t for p in series[:series.index(pr)] for t in self.project_tests.get(p, [])]
        if not flagged or not earlier:
            return
        self.write_files(state)
        args = ["--paths", "core", "--world-sizes", "2", "--rank-timeout", str(self.args.rank_timeout)]
        suites = [Suite("earlier", self.src, self.env, args, earlier)]
        key = f"{pr} (earlier PRs' tests)"
        self.baseline(pr, suites, key)
        b = self.baselines[key]
        log(f"{pr}: earlier PRs' tests, baseline {b['tests']} passed, {len(b['failed'])} failed in "
            f"{b['seconds']:.0f} s")
        noticers: list[str] = []
        for hunk in flagged:
            result = self.check_hunk(hunk, state, suites, noticers)
            if result.test and result.outcome in ("noticed", "hang") and result.test not in noticers:
                noticers.insert(0, result.test)
            self.results[hunk.key]["wider"] = {
                "outcome": result.outcome,
                "test": result.test,
                "seconds": result.seconds
            }
            self.save_results()
            log(f"{pr} {hunk.file} #{hunk.index}: earlier PRs' tests: {describe(result)} [{result.seconds:.0f} s]")

    # ----- report -----

    def write_report(self, series: list[str]) -> None:
        rows = [r for r in self.results.values()]
        order = {name: i for i, name in enumerate(series)}
        rows.sort(key=lambda r: (order.get(r["pr"], 99), r["file"], r["index"]))
        counts: dict[str, dict[str, int]] = {}
        for r in rows:
            counts.setdefault(r["pr"], {}).setdefault(category(r), 0)
            counts[r["pr"]][category(r)] += 1
        in_tree = (", plus the `tests/unit` files its patch adds or changes (upstream's `DistributedTest` harness, "
                   "run from a copy of the tree's `tests/`)" if self.base != "0.19.3" else "")
        lines = [
            f"# Hunk-removal check: the {self.base} series",
            "",
            f"Checked: the committed series of main at `{self.commit}` (`git archive` of that commit, its "
            f"`patches/deepspeed-{self.base}/` materialized; uncommitted work is not in it), against deepspeed "
            f"`{self.installed_version}` installed in a virtualenv with each PR's `deepspeed/` files written over it. "
            f"Command: `nice python -m ds_series.hunk_check --base {self.base}` ({time.strftime('%Y-%m-%d')}); see "
            "CONTRIBUTING.md, \"Hunk-removal check\".",
            "",
            "Each production hunk (the PR's diff in `deepspeed/`, cut as in its patch, 3 lines of context) was undone "
            "alone in the tree as of its PR, and that PR's tests ran with `-x`: the project's tests that belong to it "
            f"(world size 2, `--paths core`, without tests/tinker_server and tests/tooling){in_tree}. "
            "*noticed by* names the first test that failed; **NOT NOTICED**: every one of them passed without the "
            "hunk. *comments only*: the hunk changes comments or docstrings only (the syntax trees without docstrings "
            "are equal), so no test can notice it; not flagged. *import error*: the file without the hunk does not "
            "compile or import (weak evidence: no test of the behaviour). *hang*: a test or the whole run timed out.",
            "",
            "## Summary",
            "",
            "| PR | hunks | noticed | hang | import error | comments only | NOT NOTICED | baseline: passed / failed / "
            "skipped, time |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for pr in series:
            if pr not in counts:
                continue
            c = counts[pr]
            b = self.baselines.get(pr, {})
            base_cell = (f"{b.get('tests', 0)} / {len(b.get('failed', []))} / {b.get('skipped', 0)}, "
                         f"{b.get('seconds', 0):.0f} s" if b else "")
            lines.append(f"| `{pr}` | {sum(c.values())} | {c.get('noticed', 0)} | {c.get('hang', 0)} | "
                         f"{c.get('import-error', 0)} | {c.get('comments-only', 0)} | "
                         f"{c.get('not-noticed', 0) + c.get('no-tests', 0)} | {base_cell} |")
        total = {
            k: sum(c.get(k, 0) for c in counts.values())
            for k in ("noticed", "hang", "import-error", "comments-only", "not-noticed", "no-tests")
        }
        lines.append(f"| all | {len(rows)} | {total['noticed']} | {total['hang']} | {total['import-error']} | "
                     f"{total['comments-only']} | {total['not-noticed'] + total['no-tests']} | |")
        undone = [(pr, n - sum(counts.get(pr, {}).values())) for pr, n in self.hunk_counts.items()
                  if n > sum(counts.get(pr, {}).values())]
        if undone:
            lines += ["", "Not checked (yet): " + ", ".join(f"`{pr}` ({n} hunks)" for pr, n in undone) + "."]
        flagged = [r for r in rows if category(r) in ("not-noticed", "no-tests")]
        lines += ["", f"## Flagged: no test notices these hunks ({len(flagged)})", ""]
        if not flagged:
            lines.append("None.")
        for r in flagged:
            lines += hunk_block(r)
        weak = [r for r in rows if category(r) == "import-error"]
        if weak:
            lines += ["", f"## Noticed only as an import error ({len(weak)})", ""]
            for r in weak:
                lines += hunk_block(r)
        comments = [r for r in rows if category(r) == "comments-only"]
        if comments:
            lines += ["", f"## Comments and docstrings only, not flagged ({len(comments)})", ""]
            for r in comments:
                lines.append(f"- `{r['pr']}`, `{r['file']}`, hunk #{r['index']} `{r['header']}` ({r['lines']})")
        failing = {pr: b for pr, b in self.baselines.items() if b.get("failed")}
        if failing:
            lines += ["", "## Baseline failures (left out of the check)", ""]
            for pr, b in failing.items():
                lines += [f"- `{pr}`: " + ", ".join(f"`{t}`" for t in b["failed"])]
        lines += [
            "", "## Every hunk", "", "| PR | file | hunk | lines | result | s |",
            "| --- | --- | --- | --- | --- | --- |"
        ]
        for r in rows:
            lines.append(f"| `{r['pr']}` | `{r['file']}` | #{r['index']} `{r['header']}` | {r['lines']} | "
                         f"{describe_md(r)} | {r['seconds']:.0f} |")
        lines += [
            "", f"Time: {sum(r['seconds'] for r in rows) / 60:.0f} min in the hunks' runs, "
            f"{sum(b.get('seconds', 0) for b in self.baselines.values()) / 60:.0f} min in the baselines (2 cores, "
            "shared with other work).", ""
        ]
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        self.report_path.write_text("\n".join(lines))


def describe(r: Result | dict) -> str:
    r = asdict(r) if isinstance(r, Result) else r
    return {
        "noticed": f"noticed by {r['test']}",
        "hang": f"noticed (hang) by {r['test'] or 'the run'}",
        "import-error": f"noticed (import error) {r['message'][:120]}",
        "not-noticed": "NOT NOTICED",
        "no-tests": "NOT NOTICED (the PR has no tests here)",
        "comments-only": "comments or docstrings only (nothing a test can notice)",
    }[category(r)]


def category(r: dict) -> str:
    """A result's kind in the report: a hunk of comments and docstrings only is not flagged, whatever ran."""
    if r["outcome"] in ("not-noticed", "no-tests") and r.get("comment_only"):
        return "comments-only"
    return r["outcome"]


def _text(data: bytes | None) -> str | None:
    return data.decode() if data is not None else None


def describe_md(r: dict) -> str:
    text = describe(r).replace("|", "\\|")
    if r["outcome"] in ("noticed", "hang") and r["test"]:
        text = text.replace(r["test"], f"`{r['test']}`")
    if category(r) in ("not-noticed", "no-tests"):
        text = f"**{text}**"
    return text


def hunk_block(r: dict) -> list[str]:
    out = [
        f"- `{r['pr']}`, `{r['file']}`, hunk #{r['index']} `{r['header']}` ({r['lines']}): {describe(r)}", "",
        "  ```diff"
    ]
    out += [f"  {line}" for line in r["changes"]]
    out += ["  ```", ""]
    wider = r.get("wider")
    if wider:
        found = {
            "noticed": f"noticed by `{wider['test']}`",
            "hang": f"noticed (hang) by `{wider['test']}`",
            "import-error": "noticed (import error)"
        }.get(wider["outcome"], "**not noticed either**")
        out[0] += f". The earlier PRs' tests: {found}"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-series-hunk-check",
                                     description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base",
                        default=os.environ.get(stack.BASE_ENV) or stack.DEFAULT_BASE,
                        help=f"the series to check (default ${stack.BASE_ENV} or {stack.DEFAULT_BASE})")
    parser.add_argument(
        "--venv",
        default=None,
        help="virtualenv with the base's whole series installed non-editable (default .venv-hunks-<base>)")
    parser.add_argument("--rev", default="HEAD", help="commit of this repository to check (default HEAD)")
    parser.add_argument("--prs", nargs="+", metavar="NAME", help="check only these PRs (default: every PR)")
    parser.add_argument("--report", help="the Markdown report to write (default tools/results/hunk-check-<base>.md)")
    parser.add_argument("--context",
                        type=int,
                        default=3,
                        help="lines of context of the diff the hunks are cut from (default 3, as in the patches; 0 "
                        "splits them finer)")
    parser.add_argument("--rank-timeout",
                        type=float,
                        default=150,
                        help="per-test timeout on the ranks, seconds (default 150; a test's own rank_timeout wins)")
    parser.add_argument("--timeout-factor",
                        type=float,
                        default=2.0,
                        help="a hunk's run is killed (a hang) after this many times its suite's baseline, plus 120 s")
    parser.add_argument("--baseline-timeout", type=float, default=3600, help="seconds for one baseline run")
    parser.add_argument("--ignore",
                        nargs="*",
                        default=list(IGNORED_TEST_PATHS),
                        help=f"project test paths left out (default {' '.join(IGNORED_TEST_PATHS)})")
    parser.add_argument("--wider",
                        action="store_true",
                        help="for each hunk its PR's tests do not notice, also run the tests of the PRs before it (in "
                        "the same tree) and report whether one of those notices it")
    parser.add_argument("--report-only",
                        action="store_true",
                        help="write the report from the results kept for the commit, running nothing")
    parser.add_argument("--fresh", action="store_true", help="discard results kept from an earlier run of this commit")
    args = parser.parse_args(argv)
    args.venv = args.venv or str(ROOT / f".venv-hunks-{args.base}")
    return Checker(args).main()


if __name__ == "__main__":
    sys.exit(main())
