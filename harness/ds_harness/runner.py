"""``run_on_ranks``: validate the body, run it on a pool, and conclude.

Bodies are sent by reference (module, file path, qualified name), never pickled by value,
so they must be module-level functions of an importable test file.
"""

from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Callable

from . import launch, pools, report
from . import protocol as P


@dataclass
class Settings:
    """Defaults for every run; conftest.py fills them from command-line options."""

    timeout: float = float(os.environ.get("DS_HARNESS_TIMEOUT", 300))
    """Seconds a test may run on its ranks before the group is killed."""
    grace: float = 3.0
    """Seconds other ranks get to report after one rank failed (they are often stuck in a collective)."""
    start_timeout: float = 180.0
    """Seconds a pool may take to start (spawn, imports, rendezvous); not charged to the test."""
    seed: int = 1234
    init: str = os.environ.get("DS_HARNESS_INIT", "auto")
    """How ranks initialise: ``auto`` (deepspeed.comm if DeepSpeed is installed), ``deepspeed``, ``torch``."""
    keep_pool_after_every_rank_raised: bool = False
    """Keep a pool whose every rank raised (none died, hung or was killed: each left the body, none is in a collective)
    instead of starting a fresh one. ``--regressions-on-pristine`` sets it: there every test fails by design, and a
    fresh pool per test costs seconds of spawning and imports."""


SETTINGS = Settings()


def run_on_ranks(body: Callable[..., Any],
                 world_size: int,
                 *args: Any,
                 timeout: float | None = None,
                 seed: int | None = None,
                 init: str | None = None,
                 **kwargs: Any) -> list[Any]:
    """Run ``body(*args, **kwargs)`` on ranks 0..world_size-1; return its values indexed by rank.

    Raises ``RankError``/``RankTimeout`` naming the failed ranks (the pool is then discarded),
    or skips the calling test when every rank skipped. ``timeout``, ``seed`` and ``init`` are
    harness options and are not passed to ``body``; ``init="torch"`` selects a separate pool
    initialised without DeepSpeed (cheaper to restart, for tests of the harness itself).
    """
    __tracebackhide__ = True
    task = _make_task(body, args, kwargs, SETTINGS.seed if seed is None else seed)
    timeout = SETTINGS.timeout if timeout is None else timeout
    init = SETTINGS.init if init is None else init
    pool = ensure_pool(world_size, init)
    try:
        outcomes = pool.run(task, timeout, SETTINGS.grace)
    except BaseException:  # e.g. Ctrl-C mid-run: ranks may still answer this task later
        pools.discard_pool(world_size, init)
        raise
    statuses = {o["status"] for o in outcomes}
    kept = ({P.OK}, {P.SKIP}, {P.ERROR}) if SETTINGS.keep_pool_after_every_rank_raised else ({P.OK}, {P.SKIP})
    if statuses not in kept:
        pools.discard_pool(world_size, init)
    _echo_output(outcomes)
    return report.conclude(outcomes, timeout)


def ensure_pool(world_size: int, init: str | None = None) -> pools.RankPool:
    """The live pool for ``world_size``; skips the test if this machine has too few GPUs."""
    __tracebackhide__ = True
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cap = launch.max_world_size()
    if cap is not None and world_size > cap:
        import pytest

        pytest.skip(f"world size {world_size} needs {world_size} GPUs, found {cap}")
    return pools.get_pool(world_size, SETTINGS.init if init is None else init, SETTINGS.start_timeout)


def _make_task(body: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], seed: int) -> dict[str, Any]:
    """Check in the parent what would otherwise fail confusingly on every rank."""
    module_name = getattr(body, "__module__", None)
    qualname = getattr(body, "__qualname__", None)
    module = sys.modules.get(module_name or "")
    path = getattr(module, "__file__", None)
    if not callable(body) or module is None or path is None or qualname is None:
        raise TypeError(f"{body!r} is not a function of an importable module")
    if "<" in qualname or module_name == "__main__":
        raise TypeError(f"{module_name}.{qualname} must be a module-level function of a test file "
                        "(ranks import it by name; lambdas, closures and __main__ cannot be found)")
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is not body and getattr(obj, "__func__", None) is not body:
        raise TypeError(f"{module_name}.{qualname} does not resolve to the body passed in "
                        "(shadowed or wrapped by a decorator without functools.wraps?)")
    try:
        payload = pickle.dumps((args, kwargs))
    except Exception as exc:
        raise TypeError(f"arguments for {qualname} are not picklable: {exc!r}") from exc
    return P.make_task(module_name, os.path.realpath(path), qualname, payload, seed, os.getcwd())


def _echo_output(outcomes: list[dict[str, Any]]) -> None:
    """Ranks' output into the test's captured stdout (pytest shows it when the test fails)."""
    for o in outcomes:
        if o["output"].strip():
            sys.stdout.write(f"----- rank {o['rank']} output -----\n{o['output'].rstrip()}\n")
    sys.stdout.flush()
