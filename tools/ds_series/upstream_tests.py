#!/usr/bin/env python3
"""Upstream's own unit tests, run on the pristine release and on the series, compared test by test.

A DeepSpeed maintainer takes a PR when upstream's CI stays green. The project's own suite checks what the series
promises; this tool checks what it must not break: upstream's test files next to the code the PRs touch
(``tests/unit/v1/zero``, ``tests/unit/runtime`` with the config tests, ...), from the upstream revision each series
is based on (tag v0.19.3 for 0.19.3; commit edaa722 for 0.19.8, the closest tree to 0.19.8 there is), run on
DeepSpeed's CPU accelerator (gloo) once against the pristine release (``stack.py install --upto 0``) and once
against the whole series, in the same virtualenv. A test that passes on pristine and fails on the series is a
regression: the run exits 1. Every other difference is listed in the report.

The rules, per test id (the pytest node id under ``tests/``):

- Each side runs its own version of every test file: pristine runs upstream's; the series runs the series' tree,
  i.e. upstream's tests with the PRs' changes and new files laid over them. A test that a PR changes (say, to
  expect ``DeepSpeedConfigError`` where upstream expected ``AssertionError``) is judged by the outcome of the
  series' version under the same id.
- Red (exit 1): passed on pristine and failed, errored, hung or was not collected on the series; or exists only
  on the series (a PR's new or renamed test) and fails there. Red tests are run once more on the series; one that
  passes then is reported as flaky, not red.
- Listed, not red: a pristine pass whose id the series removed together with a change to its file (a rename),
  tests failing on both (upstream's, on this machine), tests the series fixes, and outcome changes between
  pass and skip.
- Both sides use one harness: ``tests/unit/common.py`` of the series' tree if the series changes it (0.19.8's
  ``fix-cpu-test-harness`` on upstream's #8397, a backport below that series), else upstream's with both applied
  (0.19.3; the file is the same at both revisions). Without it the harness cannot compare tensors across ranks on
  gloo, and a failing ``pytest.raises`` in a rank hangs the run instead of failing the test
  (``../shared/upstream/README.md``).

Both installs share one virtualenv and its ``$TORCH_EXTENSIONS_DIR``: ``stack.py install`` keeps the times of
op sources that did not change, so the JIT-built ops (CPU Adam, shared-memory comm) are built once per base, not
once per side. The test files are copied out to ``scratch/upstream-tests/<base>/<side>/tests``: upstream's
``tests/conftest.py`` makes the folder above ``tests/`` importable first, and the copy holds no ``deepspeed``
package, so the tests import the installed one.

Hangs: the harness ends the whole session on a hung test (and may then block closing the hung pool), so each
session writes its events as they happen (``ds_series.upstream_tests_plugin``); a test that runs longer than
``--timeout`` is killed with its session, counted as hung, and a new session resumes after it.

    python -m ds_series.upstream_tests  # both bases, every file of the scope; tools/results/upstream-tests.md
    python -m ds_series.upstream_tests --base 0.19.8 --subset ci --python .ci-venv-0.19.8/bin/python   # what CI runs
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import fnmatch
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ds_series import stack
from local_ranks.procs import clean_shm, kill_tree, shm_files

ROOT = stack.ROOT

#: The pytest plugin each session loads (ds_series.upstream_tests_plugin, imported there, not here: it needs pytest),
#: and the environment variables it reads (the same names as there).
PLUGIN = "ds_series.upstream_tests_plugin"
PLUGIN_LOG_ENV = "DS_UPSTREAM_TESTS_LOG"
PLUGIN_PRELOAD_ENV = "DS_UPSTREAM_TESTS_PRELOAD"

#: Upstream's test tree (the folder holding ``tests/``) per base, relative to the repository root, and the
#: revision it is. A base with ``[extras]`` in base.toml defaults to that folder (the same revision its PRs' tests
#: are written against).
UPSTREAM_TESTS = {
    "0.19.3": ("../shared/upstream-0.19.3", "tag v0.19.3 (0c36f6d3efb8)"),
}
#: Environment variable overriding the folder for one base: DS_UPSTREAM_TESTS_0_19_3=/path/holding/tests.
UPSTREAM_TESTS_ENV = "DS_UPSTREAM_TESTS_{}"

#: The test paths (under ``tests/``) the comparison runs: upstream's tests next to the code the PRs touch.
#: ZeRO stages 1-3, offload and the user-backward API (``v1/zero``); the engine, config, precision, ZeRO config and
#: ZeRO-3 runtime tests (``runtime``, which holds the config tests ``test_ds_config_dict.py``,
#: ``test_ds_config_model.py`` and ``zero/test_zero_config.py``); the bf16/fp16 optimizers (``v1/half_precision``);
#: the hybrid engine; engine and ZeRO checkpoints; the DistributedTest harness's test a PR adds (``v1/``).
FULL_SCOPE = ("unit/v1/zero", "unit/runtime", "unit/v1/half_precision", "unit/hybrid_engine", "unit/checkpoint",
              "unit/v1/test_dist_harness.py")

#: What CI runs (``--subset ci``; see CONTRIBUTING.md, "What CI runs", for how it was chosen): these files (under
#: ``tests/``), which exercise every file a PR of either series touches, with ONE parametrization of each test
#: function (the first collected: the others repeat it for another stage, dtype or option), plus every test file the
#: series adds (whole) and, in an upstream file the series changes, every parametrization of each test function it
#: changes.
CI_SUBSET: tuple[str, ...] = (
    # ZeRO stages 1-3, offload, backward and the accumulation boundary: stage_1_and_2.py, stage3.py,
    # partition_parameters.py, base_optimizer.py, engine.py's backward()/step()
    "unit/v1/zero/test_zero_user_backward.py",
    "unit/v1/zero/test_zero2_offload_multi_backward.py",
    "unit/v1/zero/test_zero_cpu_offload_grad_accum.py",
    "unit/v1/zero/test_zero_coalesce_grad_reduction.py",
    "unit/v1/zero/test_offload_states.py",
    "unit/runtime/zero/test_zero_context_return.py",
    "unit/runtime/zero/test_zero_grad_clip.py",
    "unit/runtime/zero/test_ignore_unused_parameters.py",
    # config.py, constants.py: the config tests
    "unit/runtime/test_ds_config_dict.py",
    "unit/runtime/test_ds_config_model.py",
    "unit/runtime/zero/test_zero_config.py",
    # engine.py: no_sync(), checkpoints
    "unit/runtime/test_no_sync_ctxt.py",
    "unit/checkpoint/test_latest_checkpoint.py",
    # bf16_optimizer.py, fp16/fused_optimizer.py, fp16/unfused_optimizer.py
    "unit/v1/half_precision/test_bf16.py",
    "unit/runtime/half_precision/test_zero_optim_overflow.py",
    # hybrid_engine.py
    "unit/runtime/rollout/test_hybrid_engine_rollout.py",
)

#: The CI subset's test ids per base (``--subset ci``), when committed: of the first parametrization of each test
#: function in CI_SUBSET, those that passed on pristine in the committed comparison
#: (tools/results/upstream-tests.md); a test that fails or skips on pristine can never be red, so CI does not pay for
#: it. ``--write-ci-ids`` writes it.
CI_IDS = ROOT / "tests" / "upstream-ci" / "{base}.txt"

#: Outcomes that count as a failure on the series side.
FAILING = {"failed", "error", "timeout", "crashed", "not collected"}
PASSING = {"passed", "xpassed"}
#: The outcome of a test the time limit (``--time-limit``) left unrun: neither passing nor failing.
NOT_RUN = "not run"
#: Seconds a hung harness waits before ending the session itself (``DS_UNITTEST_TIMEOUT``): below --timeout, so
#: that the harness's own message comes first when it can.
HARNESS_TIMEOUT_MARGIN = 30
#: The most sessions one side may take (one more after each hang); a guard against a loop.
MAX_SESSIONS = 60
#: The ops DeepSpeed's CPU accelerator JIT-builds (op_builder/cpu), built once per install before any test runs:
#: built by the first test that needs one, minutes of compiling land in that test's timeout on two cores (and a
#: killed build starts again in the next). FusedAdam is what the CPU accelerator uses for the "Adam" optimizer type.
OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder")


@dataclass
class Side:
    """One side of the comparison: pristine (no PR) or the whole series."""

    name: str
    upto: int
    version: str = ""
    outcomes: dict[str, str] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    collect_errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    install_seconds: float = 0.0
    sessions: int = 0
    #: Run only on the series' failures (``--pristine on-failure``): a test it did not run passed there in the
    #: committed comparison the CI ids come from.
    partial: bool = False


def log(message: str) -> None:
    print(f"[upstream_tests] {message}", flush=True)


# --------------------------------------------------------------------------------------------
# Inputs: the base, its upstream tests, the virtualenv
# --------------------------------------------------------------------------------------------


def upstream_tests_folder(base: str) -> tuple[Path, str]:
    """The folder holding upstream's ``tests/`` for ``base`` and a description of its revision."""
    override = os.environ.get(UPSTREAM_TESTS_ENV.format(base.replace(".", "_")))
    if base in UPSTREAM_TESTS:
        folder, revision = UPSTREAM_TESTS[base]
        folder = ROOT / folder
    else:
        extras = stack.load_base(base).extras
        if extras is None:
            raise SystemExit(f"error: no upstream tests known for {base}: add it to UPSTREAM_TESTS")
        folder, revision = extras.source, f"commit {extras.commit[:12]}"
    folder = Path(override) if override else folder
    if not (folder / "tests" / "unit" / "common.py").is_file():
        raise SystemExit(f"error: upstream's tests for {base} ({revision}) are not at {folder}/tests; set "
                         f"${UPSTREAM_TESTS_ENV.format(base.replace('.', '_'))} to a folder holding them (e.g. "
                         "`git clone https://github.com/deepspeedai/DeepSpeed` checked out at that revision)")
    return folder.resolve(), revision


def venv_of(python: str) -> Path:
    """The virtualenv of ``<venv>/bin/python``. Not ``resolve()``: a virtualenv's python is a symlink to the
    interpreter it was made from, and following it would install both sides into that interpreter instead."""
    return Path(python).absolute().parent.parent


def default_venv(base: str) -> Path:
    return ROOT / f".venv-upstream-{base}"


def ensure_venv(base: str, venv: Path, env: dict[str, str]) -> Path:
    """The virtualenv's Python, creating the virtualenv the way tools/test.sh does (torch, requirements, the
    series, the JIT-built ops) if it does not exist yet."""
    python = venv / "bin" / "python"
    if not python.exists():
        log(f"creating {venv} (tools/test.sh --install-only, DeepSpeed {base} + its series)")
        subprocess.run(["bash", str(ROOT / "tools" / "test.sh"), "--install-only"], check=True,
                       env={**env, "DS_SERIES_BASE": base, "DS_SERIES_VENV": str(venv)})
    return python


def side_env(base: str, venv: Path, local_size: int, timeout: int, preload: bool) -> dict[str, str]:
    """The environment of every install and test session of one base."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update({
        "DS_ACCELERATOR": "cpu",
        # The CPU accelerator's device count: tests that need more ranks skip, on both sides alike.
        "LOCAL_SIZE": str(local_size),
        "DS_UNITTEST_TIMEOUT": str(max(30, timeout - HARNESS_TIMEOUT_MARGIN)),
        "TORCH_EXTENSIONS_DIR": env.get("TORCH_EXTENSIONS_DIR") or str(venv / "torch_extensions"),
        "PYTHONUNBUFFERED": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    })
    if preload:
        # ds_series.cpu_info_preload: py-cpuinfo asked once there, not by every rank of every test (a subprocess each).
        env[PLUGIN_PRELOAD_ENV] = "ds_series.cpu_info_preload,torch,deepspeed"
    # The JIT ops' build command includes the compiler: the one CI builds with (.ci/bin/g++, no debug information),
    # unless the caller sets another; a different one would rebuild every op on first use.
    if "CXX" not in env and shutil.which("g++"):
        env["CXX"] = str(ROOT / ".ci" / "bin" / "g++")
    return env


# --------------------------------------------------------------------------------------------
# One side: install, lay out the tests, run them
# --------------------------------------------------------------------------------------------

_INSTALL_SNIPPET = """
import sys
from pathlib import Path
from ds_series import stack
import dataclasses
base = dataclasses.replace(stack.load_base(sys.argv[1]), prefix_dir=Path(sys.argv[2]))
try:
    print(stack.install(base, int(sys.argv[3]), editable=False))
except stack.StackError as err:
    sys.exit(f"error: {err}")
"""


def install(python: Path, base: str, upto: int, prefix_dir: Path, env: dict[str, str]) -> Path:
    """``stack.py install --upto K`` into the virtualenv, with its prefix trees in our own folder: ``build/<base>``
    is shared with whoever else runs ``stack.py install``, and a concurrent install would remove the tree we copy
    the tests from. Returns the tree."""
    subprocess.run([str(python), "-c", _INSTALL_SNIPPET, base, str(prefix_dir), str(upto)], check=True,
                   env=env, cwd=ROOT)
    return prefix_dir / f"deepspeed-upto-{upto}"


_BUILD_OPS_SNIPPET = """
import sys
from deepspeed.accelerator import get_accelerator
for name in sys.argv[1:]:
    builder = get_accelerator().create_op_builder(name)
    if builder is None or not builder.is_compatible(verbose=False):
        print(f"[upstream_tests] {name}: not available here (the tests that need it skip or fail on both sides)")
        continue
    builder.load(verbose=False)
"""


def require_virtualenv(python: Path) -> None:
    """Both sides are installed with pip into ``python``'s environment: refuse one that is not a virtualenv (a
    system interpreter would get DeepSpeed, and whatever torch pip picks, installed into it)."""
    out = subprocess.run([str(python), "-c", "import sys; print(sys.prefix != sys.base_prefix)"], check=True,
                         capture_output=True, text=True).stdout.strip()
    if out != "True":
        raise SystemExit(f"error: {python} is not the Python of a virtualenv; pass --python <venv>/bin/python")


def build_ops(python: Path, env: dict[str, str]) -> None:
    """JIT-build (or load, when built) the CPU accelerator's ops for the installed DeepSpeed, outside any test."""
    clear_stale_locks(env)
    subprocess.run([str(python), "-c", _BUILD_OPS_SNIPPET, *OPS], check=True, env=env, cwd="/")


def installed_version(python: Path, env: dict[str, str]) -> str:
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"],
                         check=True, env=env, capture_output=True, text=True, cwd="/").stdout
    return out.strip().splitlines()[-1]


def lay_out_tests(upstream: Path, tree: Path, dest: Path) -> None:
    """``dest/tests``: upstream's test tree with the installed tree's ``tests/`` (the PRs' changes) laid over it."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(upstream / "tests", dest / "tests", ignore=ignore)
    if (tree / "tests").is_dir():
        shutil.copytree(tree / "tests", dest / "tests", ignore=ignore, dirs_exist_ok=True)


#: What makes ``tests/unit/common.py`` work on the CPU accelerator, oldest first: upstream's #8397 (merged after the
#: 0.19.8 series' pinned test tree, which lays it in as a backport) and the 0.19.8 series' ``fix-cpu-test-harness``;
#: each with a line that shows it is in.
HARNESS_FIXES = (
    (Path("patches/deepspeed-0.19.8/upstream-backports/8397-test-device-names.patch"),
     "device = get_accelerator().current_device_name()"),
    (Path("patches/deepspeed-0.19.8/fix-cpu-test-harness.patch"), "elif isinstance(e, Failed) and not isinstance("),
)


def fix_harness(tests: Path) -> str:
    """Apply upstream's #8397 and the 0.19.8 series' ``fix-cpu-test-harness`` to ``tests/unit/common.py`` where they
    are not in yet; returns what was done, for the report."""
    common = tests / "unit" / "common.py"
    done = []
    for relative, marker in HARNESS_FIXES:
        if marker in common.read_text(encoding="utf-8"):
            continue
        patch = ROOT / relative
        # In a scratch folder outside any git repository: inside one (scratch/ is in this one) `git apply` takes the
        # patch's paths as relative to the repository's root and skips them.
        with tempfile.TemporaryDirectory() as scratch:
            target = Path(scratch) / "tests" / "unit" / "common.py"
            target.parent.mkdir(parents=True)
            shutil.copy2(common, target)
            result = subprocess.run(["git", "apply", "--include=tests/unit/common.py", str(patch)], cwd=scratch,
                                    capture_output=True, text=True,
                                    env={**os.environ, "GIT_CEILING_DIRECTORIES": scratch})
            if result.returncode != 0 or target.read_bytes() == common.read_bytes():
                raise SystemExit(f"error: {patch.name} does not apply to {common}: {result.stderr.strip()}")
            shutil.copy2(target, common)
        done.append(f"{relative} applied")
    return "; ".join(done) or "already fixed"


def series_changed_files(pristine_tests: Path, series_tests: Path, scope: tuple[str, ...]) -> list[str]:
    """Test files (under ``tests/``, within the scope) that the series adds or changes."""
    changed = []
    for path in sorted(series_tests.rglob("*.py")):
        relative = path.relative_to(series_tests).as_posix()
        if not any(relative == s or relative.startswith(s.rstrip("/") + "/") for s in scope):
            continue
        other = pristine_tests / relative
        if not other.is_file() or other.read_bytes() != path.read_bytes():
            changed.append(relative)
    return changed


def _function_sources(path: Path) -> dict[str, str]:
    """``Class::function`` (or ``function``) -> its source with decorators (and its class's decorators), for every
    test function of a test file."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text)

    def source(node: ast.AST) -> str:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return "\n".join(lines[first - 1:node.end_lineno])

    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            found[node.name] = source(node)
        elif isinstance(node, ast.ClassDef):
            header = "\n".join(ast.get_source_segment(text, d) or "" for d in node.decorator_list)
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name.startswith("test"):
                    found[f"{node.name}::{child.name}"] = header + "\n" + source(child)
    return found


def kept_whole(pristine_tests: Path, series_tests: Path, changed: list[str]) -> list[str]:
    """What ``--subset ci`` runs in every parametrization: each test file the series adds, and each test function
    the series changes in an upstream file (as ``file::Class::function``)."""
    whole = []
    for relative in changed:
        before = pristine_tests / relative
        if not before.is_file():
            whole.append(relative)
            continue
        old, new = _function_sources(before), _function_sources(series_tests / relative)
        whole.extend(f"{relative}::{name}" for name, text in new.items() if old.get(name) != text)
    return whole


def select_paths(tests: Path, scope: tuple[str, ...], patterns: tuple[str, ...], extra: list[str]) -> list[str]:
    """The test paths to pass to pytest: the scope's files matching ``patterns`` (whole folders when a pattern is a
    folder of the scope), plus ``extra``, each only if it exists on this side."""
    chosen: list[str] = []
    for pattern in patterns:
        if (tests / pattern).exists():
            chosen.append(pattern)
            continue
        for path in sorted(tests.rglob("test_*.py")):
            relative = path.relative_to(tests).as_posix()
            if fnmatch.fnmatch(relative, pattern):
                chosen.append(relative)
    for relative in extra:
        if (tests / relative).is_file() and relative.rsplit("/", 1)[-1].startswith("test_"):
            chosen.append(relative)
    # A file under a chosen folder is already in.
    unique = []
    for path in chosen:
        if path not in unique and not any(path.startswith(other + "/") for other in chosen if other != path):
            unique.append(path)
    return unique


def clear_stale_locks(env: dict[str, str]) -> None:
    """A JIT build killed with its session leaves ``<op>/lock`` behind, and every later load waits on it forever."""
    folder = Path(env["TORCH_EXTENSIONS_DIR"])
    for lock in folder.glob("*/lock"):
        log(f"removing stale JIT build lock {lock}")
        lock.unlink(missing_ok=True)


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill every process of the session's Unix session, not only its process group: ninja starts each compile of
    a JIT build in a process group of its own, and those would outlive the kill."""
    kill_tree(proc.pid)
    proc.wait()


def run_side(python: Path, side_dir: Path, paths: list[str], env: dict[str, str], timeout: int, side: Side,
             only: list[str] | None = None, options: tuple[str, ...] = (), deadline: float | None = None,
             label: str = "") -> None:
    """Run pytest over ``paths`` in ``side_dir/tests`` until every collected test has an outcome, one session after
    another: a session that hangs is killed (its running test is ``timeout``) and the next deselects what is done.
    With ``only``, just those test ids (collected from ``paths``). Past ``deadline`` (``time.monotonic()``), the
    session is killed and every test without an outcome is ``not run``."""
    tag = f"-{label}" if label else ("-rerun" if only else "")
    events = side_dir / f"events{tag}.jsonl"
    events.unlink(missing_ok=True)
    done_file = side_dir / "done.txt"
    only_file = side_dir / f"only{tag}.txt"
    if only:
        only_file.write_text("\n".join(only) + "\n", encoding="utf-8")
    outcome: dict[str, str] = {}
    expected: list[str] | None = None
    reports: dict[str, list[dict]] = {}
    start = time.monotonic()
    for session in range(1, MAX_SESSIONS + 1):
        side.sessions += 1
        done_file.write_text("\n".join(outcome) + "\n", encoding="utf-8")
        argv = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-p", PLUGIN,
                f"--basetemp={side_dir / 'tmp'}", f"--upstream-tests-done={done_file}",
                "--continue-on-collection-errors", "-q", "-rN",
                *((f"--upstream-tests-only={only_file}", ) if only else options), *paths]
        shm_before = shm_files()
        out_path = side_dir / f"pytest{tag}-{session}.log"
        with out_path.open("w") as out:
            proc = subprocess.Popen(argv, cwd=side_dir / "tests", env={**env, PLUGIN_LOG_ENV:
                                                                        str(events)},
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            offset = 0
            running: tuple[str, float] | None = None
            killed = False
            out_of_time = False
            ended = False
            # A session started in a session of its own outlives us unless killed: on any way out, kill it (the
            # caller's timeout sends SIGTERM, which main() turns into SystemExit).
            try:
                while True:
                    finished = proc.poll() is not None
                    with events.open("rb") if events.exists() else open(os.devnull, "rb") as f:
                        f.seek(offset)
                        chunk = f.read()
                        complete = chunk[:chunk.rfind(b"\n") + 1]
                        offset += len(complete)
                    for line in complete.decode("utf-8").splitlines():
                        event = json.loads(line)
                        kind = event["event"]
                        if kind == "collected" and expected is None:
                            expected = event["nodeids"]
                        elif kind == "collect_error":
                            side.collect_errors[event["nodeid"]] = event.get("longrepr", "")
                        elif kind == "start":
                            running = (event["nodeid"], time.monotonic())
                        elif kind == "report":
                            reports.setdefault(event["nodeid"], []).append(event)
                        elif kind == "sessionfinish":
                            ended = True
                        elif kind == "finish":
                            nodeid = event["nodeid"]
                            outcome[nodeid], detail, duration = _combine(reports.get(nodeid, []))
                            if detail:
                                side.details[nodeid] = detail
                            side.durations[nodeid] = duration
                            running = None
                    if finished:
                        break
                    if deadline is not None and time.monotonic() > deadline:
                        log(f"{side.name}: the time limit ran out: killing the session")
                        _kill_session(proc)
                        killed = out_of_time = True
                        break
                    if running is not None and time.monotonic() - running[1] > timeout:
                        log(f"{side.name}: {running[0]} ran over {timeout} s: killing the session")
                        _kill_session(proc)
                        killed = True
                        break
                    time.sleep(1)
            except BaseException:
                _kill_session(proc)
                raise
        removed = clean_shm(shm_before)
        if removed:
            log(f"removed {removed} shared-memory all-reduce buffer(s) the ranks left in /dev/shm")
        if killed:
            clear_stale_locks(env)
        if out_of_time:
            for nodeid in ([running[0]] if running else []) + [n for n in expected or only or [] if n not in outcome]:
                outcome[nodeid] = NOT_RUN
                side.details[nodeid] = "the time limit (--time-limit) ran out before it ended"
            log(f"{side.name}: {sum(v == NOT_RUN for v in outcome.values())} test(s) not run")
            break
        if running is not None:
            nodeid = running[0]
            outcome[nodeid] = "timeout"
            side.details[nodeid] = (f"no outcome after {timeout} s (killed)" if killed else
                                    "the session ended while it ran (the harness's hang timeout, "
                                    f"DS_UNITTEST_TIMEOUT={env['DS_UNITTEST_TIMEOUT']}, or a crash)")
            side.durations[nodeid] = time.monotonic() - running[1]
            log(f"{side.name}: {nodeid}: {outcome[nodeid]}")
        if expected is None:
            break  # nothing collected, or the session died before collecting: the log says why
        remaining = [nodeid for nodeid in expected if nodeid not in outcome]
        if not remaining:
            break
        if ended and running is None:
            # The session ran to its end: what it did not run, pytest itself deselected after our plugin listed it.
            expected = [nodeid for nodeid in expected if nodeid in outcome]
            break
        if running is None:
            # The session ended between tests without finishing them (killed from outside, pytest.exit elsewhere):
            # charge the next test, so that the loop always moves on.
            outcome[remaining[0]] = "crashed"
            side.details[remaining[0]] = f"its session ended before it started; see {out_path}"
        log(f"{side.name}: session {session} ended with {len(remaining)} test(s) left: resuming")
    else:
        log(f"{side.name}: gave up after {MAX_SESSIONS} sessions")
    side.outcomes.update(outcome)
    side.seconds += time.monotonic() - start


def _combine(reports: list[dict]) -> tuple[str, str, float]:
    """One test's outcome from its setup/call/teardown reports, the failure or skip text, and its duration."""
    outcome, detail = "passed", ""
    duration = sum(r.get("duration", 0.0) for r in reports)
    by_phase = {r["when"]: r for r in reports}
    setup, call, teardown = by_phase.get("setup"), by_phase.get("call"), by_phase.get("teardown")
    if setup and setup["outcome"] == "failed":
        return "error", setup.get("longrepr", ""), duration
    if setup and setup["outcome"] in ("skipped", "xfailed"):
        return setup["outcome"], setup.get("longrepr", ""), duration
    if call:
        outcome, detail = call["outcome"], call.get("longrepr", "")
    if teardown and teardown["outcome"] == "failed" and outcome in PASSING:
        return "error", teardown.get("longrepr", ""), duration
    return outcome, detail, duration


def run_base(base: str, args: argparse.Namespace) -> dict:
    """The whole comparison for one base; returns its results (also written to ``<out>/<base>/results.json``)."""
    base_info = stack.load_base(base)
    series = base_info.series()
    upstream, revision = upstream_tests_folder(base)
    venv = venv_of(args.python) if args.python else default_venv(base)
    env = side_env(base, venv, args.local_size, args.timeout, args.preload)
    python = Path(args.python).absolute() if args.python else ensure_venv(base, venv, env)
    require_virtualenv(python)
    work = Path(args.out).resolve() / base
    work.mkdir(parents=True, exist_ok=True)
    prefix_dir = work / "build"
    scope = tuple(args.paths) if args.paths else FULL_SCOPE
    patterns = scope if args.subset == "full" else CI_SUBSET
    pristine, series_side = Side("pristine", 0, partial=args.pristine == "on-failure"), Side("series", len(series))
    started = time.monotonic()
    deadline = started + args.time_limit if args.time_limit else None
    # The series' tree first, uninstalled: it gives both sides' harness and the test files the PRs change. Then
    # pristine, then the series: it stays installed, for rerunning red tests and for whatever runs next.
    series_tree = stack.prefix_tree(dataclasses.replace(base_info, prefix_dir=work / "trees"), series_side.upto)
    lay_out_tests(upstream, series_tree, work / "series")
    harness = fix_harness(work / "series" / "tests")
    changed = series_changed_files(upstream / "tests", work / "series" / "tests", scope)
    options: tuple[str, ...] = ()
    whole: list[str] = []
    listed: list[str] = []
    if args.subset == "ci":
        whole = kept_whole(upstream / "tests", work / "series" / "tests", changed)
        (work / "whole.txt").write_text("\n".join(whole) + "\n", encoding="utf-8")
        options = (f"--upstream-tests-one-per-function={work / 'whole.txt'}", )
        ids = Path(str(CI_IDS).format(base=base))
        if ids.is_file():
            listed = ids.read_text(encoding="utf-8").split()
            options += (f"--upstream-tests-keep={ids}", )
            log(f"{base}: the CI subset's test ids from {ids.relative_to(ROOT)}")

    reuse = [series_side] if args.series_installed else []

    def install_side(side: Side) -> None:
        t0 = time.monotonic()
        expected = stack.version_for(base_info, side.upto)
        if side in reuse:
            # Once: the caller installed the whole series (e.g. `pip install .`); a later install_side reinstalls it.
            reuse.remove(side)
            side.version = installed_version(python, env)
            if side.version != expected:
                raise SystemExit(f"error: --series-installed, but the installed deepspeed is {side.version}, "
                                 f"not {expected}")
            log(f"{base} {side.name}: deepspeed {side.version} is installed in {venv} (--series-installed)")
            build_ops(python, env)
            side.install_seconds += time.monotonic() - t0
            return
        log(f"{base} {side.name}: stack.py install --upto {side.upto} into {venv}")
        tree = install(python, base, side.upto, prefix_dir, env)
        side.version = installed_version(python, env)
        if side.version != expected:
            raise SystemExit(f"error: installed deepspeed is {side.version}, expected {expected}")
        if side is pristine and not (work / "pristine" / "tests").is_dir():
            lay_out_tests(upstream, tree, work / "pristine")
            shutil.copy2(work / "series" / "tests" / "unit" / "common.py",
                         work / "pristine" / "tests" / "unit" / "common.py")
        build_ops(python, env)
        side.install_seconds += time.monotonic() - t0

    # The test files the series adds or changes first: what a time limit cuts is upstream's unchanged tests.
    changed_tests = tuple(path for path in changed if path.rsplit("/", 1)[-1].startswith("test_"))
    paths = select_paths(work / "series" / "tests", scope, changed_tests + patterns, [])
    pristine.version = stack.version_for(base_info, pristine.upto)
    if (work / "pristine").exists():
        shutil.rmtree(work / "pristine")
    if not pristine.partial:
        install_side(pristine)
        pristine_paths = select_paths(work / "pristine" / "tests", scope, changed_tests + patterns, [])
        log(f"{base} pristine ({pristine.version}): pytest {' '.join(pristine_paths)}")
        run_side(python, work / "pristine", pristine_paths, env, args.timeout, pristine, options=options,
                 deadline=deadline)
    install_side(series_side)
    log(f"{base} series ({series_side.version}): pytest {' '.join(paths)}")
    run_side(python, work / "series", paths, env, args.timeout, series_side, options=options, deadline=deadline)
    if listed and not any(v == NOT_RUN for v in series_side.outcomes.values()):
        # A test id pristine passed that the series does not collect: the comparison below decides (renamed with
        # its changed file, or red).
        for nodeid in listed:
            series_side.outcomes.setdefault(nodeid, "not collected")
    # Failing on the series and not known to fail on pristine: each could be red.
    failing = [
        nodeid for nodeid, outcome in series_side.outcomes.items()
        if outcome in FAILING and pristine.outcomes.get(nodeid, "passed") in PASSING
    ]
    flaky: dict[str, str] = {}
    if failing and (deadline is None or time.monotonic() < deadline):
        log(f"{base}: {len(failing)} test(s) fail on the series: running them once more there")
        rerun = Side("series-rerun", series_side.upto)
        run_side(python, work / "series", paths, env, args.timeout, rerun, only=failing, deadline=deadline)
        for nodeid in failing:
            if rerun.outcomes.get(nodeid) in PASSING:
                flaky[nodeid] = series_side.details.get(nodeid, "")
        failing = [nodeid for nodeid in failing if nodeid not in flaky]
    if pristine.partial and failing:
        if deadline is not None and time.monotonic() > deadline:
            log(f"{base}: no time left to run the {len(failing)} failing test(s) on pristine: each counts as red")
        else:
            log(f"{base}: running the {len(failing)} test(s) that fail on the series on pristine")
            install_side(pristine)
            files = {_file_of(nodeid): None for nodeid in failing}
            on_pristine = [path for path in files if (work / "pristine" / "tests" / path).is_file()]
            if on_pristine:
                run_side(python, work / "pristine", on_pristine, env, args.timeout, pristine, only=failing,
                         label="failures", deadline=deadline)
            install_side(series_side)  # what runs next uses the series
    pristine_files = {p.relative_to(upstream / "tests").as_posix() for p in (upstream / "tests").rglob("*.py")}
    verdicts = compare(pristine, series_side, changed, pristine_files)
    for nodeid in flaky:
        verdicts[nodeid] = "flaky"
    results = {
        "base": base,
        "revision": revision,
        "upstream": str(upstream),
        "subset": args.subset,
        "scope": list(scope),
        "paths": paths,
        "changed_files": changed,
        "kept_whole": whole,
        "harness": harness,
        "local_size": args.local_size,
        "timeout": args.timeout,
        "seconds": time.monotonic() - started,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s)",
        "series": [p.name for p in series],
        "sides": {
            s.name: {
                "version": s.version, "outcomes": s.outcomes, "details": s.details, "durations": s.durations,
                "collect_errors": s.collect_errors, "seconds": s.seconds, "install_seconds": s.install_seconds,
                "sessions": s.sessions, "partial": s.partial
            }
            for s in (pristine, series_side)
        },
        "verdicts": verdicts,
        "flaky": flaky,
    }
    (work / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return results


# --------------------------------------------------------------------------------------------
# Comparison and report
# --------------------------------------------------------------------------------------------


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def compare(pristine: Side, series: Side, changed: list[str],
            pristine_files: set[str] | None = None) -> dict[str, str]:
    """A verdict per test id that differs or matters: ``red``, ``removed`` (gone from a file the series changed),
    ``fixed`` (fails on pristine, passes on the series), ``both-fail``, ``new`` (only on the series, not failing),
    ``not-run`` (the time limit ran out), ``changed`` (any other difference of outcome). Ids with the same outcome
    on both sides are left out. When pristine ran only the series' failures (``partial``), a test it did not run
    counts as passing there (it did in the committed comparison), and a series test is ``new`` only if its file is
    not in ``pristine_files``."""
    verdicts: dict[str, str] = {}
    changed_set = set(changed)
    series_errors = {_file_of(n) for n in series.collect_errors}
    for nodeid, before in pristine.outcomes.items():
        after = series.outcomes.get(nodeid)
        if after is None:
            file = _file_of(nodeid)
            if file in changed_set and file not in series_errors:
                verdicts[nodeid] = "removed"
                continue
            series.outcomes[nodeid] = after = "not collected"
        if after == NOT_RUN:
            verdicts[nodeid] = "not-run"
        elif before in PASSING and after in FAILING:
            verdicts[nodeid] = "red"
        elif before in FAILING and after in PASSING:
            verdicts[nodeid] = "fixed"
        elif before in FAILING and after in FAILING:
            verdicts[nodeid] = "both-fail"
        elif before != after:
            verdicts[nodeid] = "changed"
    for nodeid, after in series.outcomes.items():
        if nodeid in pristine.outcomes:
            continue
        if after == NOT_RUN:
            verdicts[nodeid] = "not-run"
        elif after in FAILING:
            verdicts[nodeid] = "red"
        elif not pristine.partial or pristine_files is None or _file_of(nodeid) not in pristine_files:
            verdicts[nodeid] = "new"
    return verdicts


def _counts(outcomes: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in outcomes.values():
        counts[value] = counts.get(value, 0) + 1
    return counts


def _tail(text: str, lines: int = 12) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _reason(text: str) -> str:
    """The error line of a failure's text (pytest's last ``E`` line), else its last line."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (errors[-1] if errors else lines[-1] if lines else "").replace("|", "\\|")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def render_base(results: dict) -> str:
    """The report section of one base."""
    base, sides, verdicts = results["base"], results["sides"], results["verdicts"]
    pristine, series = sides["pristine"], sides["series"]
    red = sorted(n for n, v in verdicts.items() if v == "red")
    lines = [
        f"## {base}: pristine {pristine['version']} against the series {series['version']}",
        "",
        f"Upstream's tests at {results['revision']}; "
        f"{'every file of the scope' if results['subset'] == 'full' else 'the CI subset'}: "
        f"`{' '.join(results['paths'])}`. Harness: {results['harness']}. CPU accelerator, "
        f"`LOCAL_SIZE={results['local_size']}`, "
        f"{results['timeout']} s per test; {results['machine']}, {results['date']}. Time: pristine "
        f"{_minutes(pristine['seconds'])} ({pristine['sessions']} session(s)), series {_minutes(series['seconds'])} "
        f"({series['sessions']} session(s)), {_minutes(results['seconds'])} in all with the installs.",
        "",
        f"**{len(red)} test(s) pass on pristine and fail on the series.**",
        "",
    ]
    if pristine.get("partial"):
        lines += [f"Pristine ran only the tests that fail on the series (`--pristine on-failure`): every other test "
                  f"id of the subset passed on pristine in the committed comparison (`tests/upstream-ci/{base}.txt`).",
                  ""]
    not_run = [n for n, v in verdicts.items() if v == "not-run"]
    if not_run:
        files = sorted({_file_of(n) for n in not_run})
        lines += [f"**{len(not_run)} test(s) not run: the time limit (`--time-limit`) ran out** (in " +
                  ", ".join(f"`{f}`" for f in files) + ").", ""]
    if results["changed_files"]:
        lines += ["Test files the series adds or changes (run on the series in its own version): " +
                  ", ".join(f"`{f}`" for f in results["changed_files"]) + ".", ""]
    outcomes = sorted(set(pristine["outcomes"].values()) | set(series["outcomes"].values()))
    pc, sc = _counts(pristine["outcomes"]), _counts(series["outcomes"])
    lines += ["| side | tests | " + " | ".join(outcomes) + " |",
              "| --- | ---: | " + " | ".join("---:" for _ in outcomes) + " |"]
    for name, side, counts in (("pristine", pristine, pc), ("series", series, sc)):
        lines.append(f"| {name} | {len(side['outcomes'])} | " + " | ".join(str(counts.get(o, 0)) for o in outcomes) +
                     " |")
    lines.append("")

    def section(title: str, kind: str, with_detail: bool = False) -> None:
        ids = sorted(n for n, v in verdicts.items() if v == kind)
        if not ids:
            return
        lines.extend([f"### {title} ({len(ids)})", ""])
        if with_detail:
            for nodeid in ids:
                lines.append(f"- `{nodeid}`: pristine {pristine['outcomes'].get(nodeid, '-')}, series "
                             f"{series['outcomes'].get(nodeid, '-')}")
                detail = _tail(series["details"].get(nodeid, "") or results["flaky"].get(nodeid, ""))
                if detail:
                    lines.extend(["", "  ```", *("  " + d for d in detail.splitlines()), "  ```"])
            lines.append("")
            return
        lines.extend(["| test | pristine | series |", "| --- | --- | --- |"])
        for nodeid in ids:
            lines.append(f"| `{nodeid}` | {pristine['outcomes'].get(nodeid, '-')} | "
                         f"{series['outcomes'].get(nodeid, '-')} |")
        lines.append("")

    section("Red: pass on pristine, fail on the series", "red", with_detail=True)
    section("Flaky on the series: failed, then passed when run again", "flaky", with_detail=True)
    section("Removed or renamed by the series (their file changed)", "removed")
    section("Fixed by the series: fail on pristine, pass on the series", "fixed")
    section("Other changes of outcome", "changed")
    new = sorted(n for n, v in verdicts.items() if v == "new")
    if new:
        per_file: dict[str, dict[str, int]] = {}
        for nodeid in new:
            counts = per_file.setdefault(_file_of(nodeid), {})
            counts[series["outcomes"][nodeid]] = counts.get(series["outcomes"][nodeid], 0) + 1
        lines += [f"### Only on the series: the PRs' new tests ({len(new)}, none failing)", "",
                  "| file | outcomes |", "| --- | --- |"]
        for file, counts in sorted(per_file.items()):
            lines.append(f"| `{file}` | " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + " |")
        lines.append("")
    both = sorted(n for n, v in verdicts.items() if v == "both-fail")
    if both:
        per_file = {}
        for nodeid in both:
            per_file[_file_of(nodeid)] = per_file.get(_file_of(nodeid), 0) + 1
        lines += [f"### Failing on both: upstream's, on this machine ({len(both)})", "",
                  "| file | tests | first failure |", "| --- | ---: | --- |"]
        for file, count in sorted(per_file.items()):
            first = next(n for n in both if _file_of(n) == file)
            reason = _reason(pristine["details"].get(first, ""))[:200]
            lines.append(f"| `{file}` | {count} | `{first.split('::', 1)[1]}`: {reason} |")
        lines.append("")
    for name, side in (("pristine", pristine), ("series", series)):
        if side["collect_errors"]:
            lines += [f"Collection errors on {name} (the same on both sides unless listed as red): " +
                      ", ".join(f"`{n}` ({_tail(t, 1)[:120]})" for n, t in sorted(side["collect_errors"].items())), ""]
    return "\n".join(lines)


REPORT_HEADER = """# Upstream's unit tests on the series

Written by `python -m ds_series.upstream_tests` (see [CONTRIBUTING.md](../../CONTRIBUTING.md#upstreams-own-tests)):
upstream's own test files next to the code the PRs touch, run on DeepSpeed's CPU accelerator against the pristine
release and against the whole series in the same virtualenv, compared test by test. A test that passes on
pristine and fails on the series is red. Each side runs its own version of each test file (the series' tree lays
the PRs' test changes over upstream's), and both use one harness (`tests/unit/common.py` with
`fix-cpu-test-harness`). Outcomes: passed, failed, error (setup or teardown), skipped (most of upstream's GPU-only
tests skip on the CPU accelerator), xfailed, timeout (hung past the per-test limit), not collected.
"""


def write_report(path: Path, results: list[dict], extra: str = "") -> None:
    text = REPORT_HEADER + (("\n" + extra.strip() + "\n") if extra.strip() else "") + "\n" + "\n\n".join(
        render_base(r) for r in results) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(re.sub(r"\n{3,}", "\n\n", text), encoding="utf-8")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-series-upstream-tests", description=__doc__.splitlines()[0])
    parser.add_argument("--base", action="append", choices=stack.available_bases(),
                        help="a base to compare (repeatable; default: every base)")
    parser.add_argument("--subset", choices=("full", "ci"), default="full",
                        help="every test file of the scope (default) or the fixed subset CI runs")
    parser.add_argument("--paths", nargs="+", metavar="PATH",
                        help=f"test paths under tests/ instead of the scope ({' '.join(FULL_SCOPE)})")
    parser.add_argument("--python", help="the Python of an existing virtualenv to install both sides into (e.g. "
                        "CI's); default .venv-upstream-<base>/bin/python, created if missing. Only with one --base")
    parser.add_argument("--timeout", type=int, default=300, help="seconds one test may run (default 300)")
    parser.add_argument("--pristine", choices=("always", "on-failure"), default="always",
                        help="run every test on pristine too (default), or only those that fail on the series: "
                        "with --subset ci the committed ids passed on pristine, so the verdicts are the same in "
                        "about half the time")
    parser.add_argument("--time-limit", type=int, default=None, metavar="SECONDS",
                        help="stop running tests after this many seconds (each base): what did not run is "
                        "reported as not run, and counts as neither passing nor failing")
    parser.add_argument("--series-installed", action="store_true",
                        help="the whole series is installed in --python's virtualenv already (as `pip install .` "
                        "leaves it): test it as it is instead of installing it again (the series' tree still gives "
                        "the test files)")
    parser.add_argument("--local-size", type=int, default=2,
                        help="ranks the CPU accelerator offers; tests needing more skip (default 2)")
    parser.add_argument("--preload", action=argparse.BooleanOptionalAction, default=True,
                        help="the harness's forkserver imports torch and DeepSpeed and asks py-cpuinfo once, so that "
                        "each test's ranks fork with them loaded (default: on)")
    parser.add_argument("--out", default=str(ROOT / "scratch" / "upstream-tests"),
                        help="working folder (default scratch/upstream-tests)")
    parser.add_argument("--report", default=None,
                        help="markdown report to write (default: tools/results/upstream-tests.md for a full run of "
                        "every base, else <out>/report.md)")
    parser.add_argument("--write-ci-ids", action="store_true",
                        help=f"write {CI_IDS.relative_to(ROOT)} from an earlier --subset ci run's results.json: the "
                        "ids that passed on pristine (not those kept whole: they always run)")
    parser.add_argument("--available", action="store_true",
                        help="only check that upstream's tests are here for the base(s): exit 0 if so, else 1")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from the results.json files of an earlier run")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    bases = args.base or stack.available_bases()
    if args.python and len(bases) != 1:
        parser.error("--python needs exactly one --base")
    if args.series_installed and not (args.python and args.pristine == "on-failure"):
        parser.error("--series-installed needs --python (the virtualenv holding the series) and --pristine on-failure "
                     "(pristine is not installed before the series)")
    whole = args.subset == "full" and not args.paths and set(bases) == set(stack.available_bases())
    report = Path(args.report) if args.report else (ROOT / "tools" / "results" / "upstream-tests.md" if whole else
                                                   Path(args.out) / "report.md")
    if args.write_ci_ids:
        for base in bases:
            results = json.loads((Path(args.out) / base / "results.json").read_text(encoding="utf-8"))
            if results["subset"] != "ci":
                parser.error(f"{base}: the results are of a --subset {results['subset']} run, not ci")
            whole = set(results["kept_whole"])
            ids = sorted(nodeid for nodeid, outcome in results["sides"]["pristine"]["outcomes"].items()
                         if outcome in PASSING and nodeid.split("[", 1)[0] not in whole
                         and _file_of(nodeid) not in whole)
            path = Path(str(CI_IDS).format(base=base))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(ids) + "\n", encoding="utf-8")
            log(f"{base}: {len(ids)} test ids to {path}")
        return 0
    if args.available:
        for base in bases:
            try:
                log(f"{base}: upstream's tests at {upstream_tests_folder(base)[0]}")
            except SystemExit as err:
                log(str(err))
                return 1
        return 0
    all_results = []
    for base in bases:
        if args.report_only:
            all_results.append(json.loads((Path(args.out) / base / "results.json").read_text(encoding="utf-8")))
        else:
            all_results.append(run_base(base, args))
    write_report(report, all_results)
    log(f"report: {report}")
    status = 0
    for results in all_results:
        red = sorted(n for n, v in results["verdicts"].items() if v == "red")
        counts = {s: _counts(results["sides"][s]["outcomes"]) for s in ("pristine", "series")}
        log(f"{results['base']}: pristine {counts['pristine']}; series {counts['series']}; "
            f"{len(red)} red, {_minutes(results['seconds'])}")
        not_run = sum(v == "not-run" for v in results["verdicts"].values())
        if not_run:
            log(f"WARNING: {results['base']}: {not_run} test(s) not run: the time limit ran out")
        for nodeid in red:
            log(f"  RED {nodeid}: pristine {results['sides']['pristine']['outcomes'].get(nodeid, '-')}, series "
                f"{results['sides']['series']['outcomes'].get(nodeid)}")
        status |= 1 if red else 0
    return status


if __name__ == "__main__":
    sys.exit(main())
