"""pytest wiring for the series' tests: PR markers and ``--upto``, world sizes, rank timeouts.

See CONTRIBUTING.md, "Tests". The rank machinery itself is the installed ds_harness package (harness/).
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from ds_harness import SETTINGS, Dist, shutdown_pools
from ds_series import stack

#: Bug-fix PRs are named ``fix-...`` and lead their series: the prefix they form is the base plus bug fixes only.
FIX_PREFIX = "fix-"
DEFAULT_WORLD_SIZE = 2
#: Folders whose tests share session fixtures that cost seconds to set up: under xdist each runs on one worker, where
#: every fixture instance is set up once (ds_harness.scheduling). The Tinker server tests on one server per ZeRO stage.
WHOLE_ON_ONE_WORKER = ("tests/tinker_server/session_servers/", )


#: The tested base: the installed DeepSpeed's, if the project has a series for it (env DS_SERIES_BASE otherwise, then
#: the default base); and its series index (env DS_SERIES_FILE names another index, for the harness's own tests).
BASE = stack.installed_base()
SERIES_FILE = Path(os.environ.get("DS_SERIES_FILE") or BASE.series_file)
#: Versions of a DeepSpeed of this base without any PR of its series (``stack.py install --upto 0`` gives the
#: second).
PRISTINE_VERSIONS = (BASE.version, stack.version_for(BASE, 0))


def read_series(series_file: Path = SERIES_FILE) -> list[str]:
    """The PRs' short names in stack order (``--upto K`` selects the first K)."""
    return [patch.name for patch in stack.read_series(series_file)]


SERIES = read_series()
MAX_PR = len(SERIES)
PR_INDEX = {name: index for index, name in enumerate(SERIES, start=1)}
FIX_PRS = [name for name in SERIES if name.startswith(FIX_PREFIX)]
#: Short names of every base's series: a test may name PRs of several (the same promise, made by each).
KNOWN_PRS = set(SERIES).union(*(read_series(stack.load_base(v).series_file) for v in stack.available_bases()))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ds-series", "DeepSpeed patch series")
    group.addoption("--upto",
                    default=None,
                    metavar="K",
                    help=f"run only tests of PRs 0..K, K a position in {SERIES_FILE} (0 = tooling, 1..{MAX_PR}) "
                    "or a PR short name; env DS_SERIES_UPTO; default: all")
    group.addoption("--regressions-on-pristine",
                    action="store_true",
                    default=False,
                    help="run only the regression tests of the bug-fix PRs (fix-*), each as a strict expected "
                    "failure: against DeepSpeed without the series (stack.py install --upto 0) this passes only "
                    "if every one of them fails there")
    group.addoption("--world-sizes",
                    default=None,
                    metavar="LIST",
                    help="comma-separated world sizes to keep, e.g. 1,2 (others are deselected); "
                    "env DS_HARNESS_WORLD_SIZES")
    group.addoption("--paths",
                    choices=("all", "core"),
                    default=os.environ.get("DS_SERIES_PATHS", "all"),
                    help="engine configurations of the tests parametrised by path_name: all (default) or core, one "
                    "or two per ZeRO stage, precision and offload mode (ds_harness.support.paths.CORE_PATHS); "
                    "env DS_SERIES_PATHS")
    group.addoption("--rank-timeout",
                    type=float,
                    default=None,
                    metavar="SECONDS",
                    help="default time a test may spend on its ranks before the group is killed; "
                    f"env DS_HARNESS_TIMEOUT; default {SETTINGS.timeout:g}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "pr(*names): the test belongs to the PR with this short name in the tested base's series "
        "(the latest of those named; the whole series if it names none of them); unmarked tests are tooling "
        "(position 0 for --upto)")
    config.addinivalue_line(
        "markers", "base(*versions, reason=...): the test applies to these bases' series only, e.g. it checks their "
        "internals (skipped on others, with the reason)")
    config.addinivalue_line(
        "markers", "world_size(*sizes): run the test once per world size through the "
        f"`dist` fixture (default {DEFAULT_WORLD_SIZE})")
    config.addinivalue_line("markers", "rank_timeout(seconds): this test's timeout on its ranks")
    config.addinivalue_line(
        "markers", "passes_on_pristine(*bases): a test of a fix-* PR that is no regression test (it checks what the "
        "fix leaves unchanged, so it passes without the fix too): --regressions-on-pristine leaves it out; with "
        "bases, only on those (a regression test on the others)")
    if config.getoption("rank_timeout") is not None:
        SETTINGS.timeout = config.getoption("rank_timeout")
    if config.getoption("regressions_on_pristine"):
        SETTINGS.keep_pool_after_every_rank_raised = True


def _upto(config: pytest.Config) -> int | None:
    value = config.getoption("upto")
    if value is None and os.environ.get("DS_SERIES_UPTO", "").strip():
        value = os.environ["DS_SERIES_UPTO"].strip()
    if value is None:
        return None
    if value in PR_INDEX:
        return PR_INDEX[value]
    try:
        upto = int(value)
    except ValueError:
        raise pytest.UsageError(f"--upto takes 0..{MAX_PR} or a PR short name of {SERIES_FILE}, got {value!r}")
    if not 0 <= upto <= MAX_PR:
        raise pytest.UsageError(f"--upto must be in 0..{MAX_PR}, got {upto}")
    return upto


def _world_sizes(config: pytest.Config) -> set[int] | None:
    raw = config.getoption("world_sizes") or os.environ.get("DS_HARNESS_WORLD_SIZES", "")
    if not raw.strip():
        return None
    try:
        sizes = {int(s) for s in raw.split(",") if s.strip()}
    except ValueError:
        raise pytest.UsageError(f"--world-sizes takes integers like 1,2; got {raw!r}")
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"--world-sizes takes positive integers; got {raw!r}")
    return sizes


def pr_name_of(item: pytest.Item) -> str | None:
    """The short name of the PR of the tested series a test belongs to (its closest ``pr`` marker; the last
    PR of the series if the marker names none of it), None for tooling."""
    marker = item.get_closest_marker("pr")
    if marker is None:
        return None
    if not marker.args or not all(name in KNOWN_PRS for name in marker.args):
        raise pytest.UsageError(f"{item.nodeid}: use @pytest.mark.pr(name, ...) with short names from a series "
                                f"index ({', '.join(SERIES)} in {SERIES_FILE}), got {marker}")
    here = [name for name in marker.args if name in PR_INDEX]
    return max(here, key=PR_INDEX.__getitem__) if here else SERIES[-1] if SERIES else None


def pr_of(item: pytest.Item) -> int:
    """The position in the series of the PR a test belongs to, 0 for tooling."""
    name = pr_name_of(item)
    return 0 if name is None else PR_INDEX[name]


def _other_base(item: pytest.Item) -> str | None:
    """Why a test of another base's series is skipped here (None if it applies to this base): it checks that
    series' internals, or it is the regression test of a bug fix this series does not carry."""
    marker = item.get_closest_marker("base")
    if marker is not None and BASE.version not in marker.args:
        why = marker.kwargs.get("reason") or f"tests the {' / '.join(marker.args)} series' internals"
        return f"{why}; this is deepspeed {BASE.version}"
    marker = item.get_closest_marker("pr")
    if marker is not None and all(n.startswith(FIX_PREFIX) and n not in PR_INDEX for n in marker.args):
        return f"regression test of {', '.join(marker.args)}, a bug fix the {BASE.version} series does not carry"
    return None


def _is_regression_test(item: pytest.Item, name: str | None) -> bool:
    """Whether a test is a regression test of a bug-fix PR, one that must fail without the fix."""
    passes = item.get_closest_marker("passes_on_pristine")
    passes_here = passes is not None and (not passes.args or BASE.version in passes.args)
    return name is not None and name.startswith(FIX_PREFIX) and not passes_here


def _check_pristine() -> None:
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    if version not in PRISTINE_VERSIONS:
        raise pytest.UsageError(f"--regressions-on-pristine needs DeepSpeed without the series "
                                f"({' or '.join(PRISTINE_VERSIONS)}; `ds-series-stack install --upto 0`), "
                                f"found deepspeed {version}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dist" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("world_size")
    sizes = marker.args if marker is not None else (DEFAULT_WORLD_SIZE, )
    if not sizes or not all(isinstance(w, int) and w >= 1 for w in sizes):
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: world_size takes positive integers, got {sizes}")
    metafunc.parametrize("dist", [pytest.param(w, id=f"w{w}") for w in sizes], indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    upto = _upto(config)
    sizes = _world_sizes(config)
    on_pristine = config.getoption("regressions_on_pristine")
    if on_pristine:
        _check_pristine()
    core_paths = None
    if config.getoption("paths") == "core":
        from ds_harness.support.paths import CORE_PATHS as core_paths
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        world_size = callspec.params.get("dist") if callspec is not None else None
        name = pr_name_of(item)  # validates every marker
        skip_reason = _other_base(item)
        if skip_reason is not None:
            item.add_marker(pytest.mark.skip(reason=skip_reason))
        if on_pristine:
            wanted = _is_regression_test(item, name)
        else:
            wanted = upto is None or pr_of(item) <= upto
        path_name = callspec.params.get("path_name") if callspec is not None else None
        if core_paths is not None and path_name is not None and path_name not in core_paths:
            wanted = False
        if not wanted or (sizes is not None and world_size is not None and world_size not in sizes):
            drop.append(item)
            continue
        if on_pristine:
            item.add_marker(
                pytest.mark.xfail(strict=True, reason=f"{name}: a regression test must fail without the fix"))
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` (tools/test.sh's): a test file per worker, and each of ``WHOLE_ON_ONE_WORKER`` whole."""
    if config.getvalue("dist") != "loadfile":
        return None
    from ds_harness.scheduling import FolderOrFileScheduling

    return FolderOrFileScheduling(config, log, folders=WHOLE_ON_ONE_WORKER)


@pytest.fixture
def dist(request: pytest.FixtureRequest) -> Dist:
    """Runs bodies on the world size this test instance is parametrised with."""
    marker = request.node.get_closest_marker("rank_timeout")
    return Dist(request.param, timeout=float(marker.args[0]) if marker is not None else None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Let ``rank_timeout`` apply to direct ``run_on_ranks`` calls too."""
    marker = item.get_closest_marker("rank_timeout")
    if marker is None:
        return (yield)
    saved, SETTINGS.timeout = SETTINGS.timeout, float(marker.args[0])
    try:
        return (yield)
    finally:
        SETTINGS.timeout = saved


def pytest_report_header(config: pytest.Config) -> list[str]:

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    upto = _upto(config)
    sizes = _world_sizes(config)
    if config.getoption("regressions_on_pristine"):
        selection = f"regression tests of {', '.join(FIX_PRS) or 'no bug-fix PR'}, expected to fail"
    else:
        selection = f"PRs 0..{MAX_PR if upto is None else upto} ({', '.join(SERIES[:upto]) or 'tooling only'})"
    return [
        f"series: {selection}; world sizes: "
        f"{'as marked' if sizes is None else ','.join(map(str, sorted(sizes)))}; "
        f"rank timeout: {SETTINGS.timeout:g} s",
        f"torch {version('torch')}, deepspeed {version('deepspeed')}",
    ]


def pytest_sessionfinish(session: pytest.Session, exitstatus: Any) -> None:
    shutdown_pools()
