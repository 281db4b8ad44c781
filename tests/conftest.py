"""pytest wiring for the series' tests: PR markers and ``--upto``, world sizes, rank timeouts.

See tests/README.md. The rank machinery itself lives in tests/harness/.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

# importlib import mode does not put this directory on sys.path; test files import `harness`.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from harness import SETTINGS, Dist, shutdown_pools  # noqa: E402

MAX_PR = 5
DEFAULT_WORLD_SIZE = 2


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ds-series", "DeepSpeed patch series")
    group.addoption("--upto",
                    type=int,
                    default=None,
                    metavar="K",
                    help=f"run only tests of PRs 0..K (0 = tooling, 1..{MAX_PR} = the series); "
                    "env DS_SERIES_UPTO; default: all")
    group.addoption("--world-sizes",
                    default=None,
                    metavar="LIST",
                    help="comma-separated world sizes to keep, e.g. 1,2 (others are deselected); "
                    "env DS_HARNESS_WORLD_SIZES")
    group.addoption("--rank-timeout",
                    type=float,
                    default=None,
                    metavar="SECONDS",
                    help="default time a test may spend on its ranks before the group is killed; "
                    f"env DS_HARNESS_TIMEOUT; default {SETTINGS.timeout:g}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"pr(K): the test belongs to PR K (1..{MAX_PR}) of the series; "
        "unmarked tests are tooling (PR 0)")
    config.addinivalue_line(
        "markers", "world_size(*sizes): run the test once per world size through the "
        f"`dist` fixture (default {DEFAULT_WORLD_SIZE})")
    config.addinivalue_line("markers", "rank_timeout(seconds): this test's timeout on its ranks")
    if config.getoption("rank_timeout") is not None:
        SETTINGS.timeout = config.getoption("rank_timeout")


def _upto(config: pytest.Config) -> int | None:
    value = config.getoption("upto")
    if value is None and os.environ.get("DS_SERIES_UPTO", "").strip():
        try:
            value = int(os.environ["DS_SERIES_UPTO"])
        except ValueError:
            raise pytest.UsageError(f"DS_SERIES_UPTO must be an integer, got {os.environ['DS_SERIES_UPTO']!r}")
    if value is not None and not 0 <= value <= MAX_PR:
        raise pytest.UsageError(f"--upto must be in 0..{MAX_PR}, got {value}")
    return value


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


def pr_of(item: pytest.Item) -> int:
    """The PR a test belongs to: its closest ``pr`` marker, else 0 (tooling)."""
    marker = item.get_closest_marker("pr")
    if marker is None:
        return 0
    if len(marker.args) != 1 or not isinstance(marker.args[0], int) or not 1 <= marker.args[0] <= MAX_PR:
        raise pytest.UsageError(f"{item.nodeid}: use @pytest.mark.pr(K) with K in 1..{MAX_PR}, got {marker}")
    return marker.args[0]


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
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        world_size = callspec.params.get("dist") if callspec is not None else None
        if (upto is not None and pr_of(item) > upto) or (sizes is not None and world_size is not None
                                                         and world_size not in sizes):
            drop.append(item)
        else:
            pr_of(item)  # validate markers of kept tests too
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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
    return [
        f"series: PRs 0..{MAX_PR if upto is None else upto}; world sizes: "
        f"{'as marked' if sizes is None else ','.join(map(str, sorted(sizes)))}; "
        f"rank timeout: {SETTINGS.timeout:g} s",
        f"torch {version('torch')}, deepspeed {version('deepspeed')}",
    ]


def pytest_sessionfinish(session: pytest.Session, exitstatus: Any) -> None:
    shutdown_pools()
