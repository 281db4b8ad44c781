"""``Dist``: what the ``dist`` fixture hands a test - a world size and a time budget."""

from __future__ import annotations

import time
from typing import Any, Callable

from .errors import RankTimeout
from .runner import SETTINGS, ensure_pool, run_on_ranks


class Dist:
    """Runs bodies on ``world_size`` ranks; all runs of one test share one timeout.

    Time spent starting a pool is not charged, so a test is not penalised for being the
    first at its world size or for following a failure.
    """

    def __init__(self,
                 world_size: int,
                 timeout: float | None = None,
                 seed: int | None = None,
                 init: str | None = None) -> None:
        self.world_size = world_size
        self.timeout = SETTINGS.timeout if timeout is None else timeout
        self.seed = SETTINGS.seed if seed is None else seed
        self.init = SETTINGS.init if init is None else init
        self.used = 0.0

    def run(self, body: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``body(*args, **kwargs)`` on every rank; returns the values indexed by rank."""
        __tracebackhide__ = True
        remaining = self.timeout - self.used
        if remaining <= 0:
            raise RankTimeout(f"test used its {self.timeout:g} s on ranks before this run", [])
        ensure_pool(self.world_size, self.init)  # start-up outside the timed section
        t0 = time.monotonic()
        try:
            return run_on_ranks(body,
                                self.world_size,
                                *args,
                                timeout=remaining,
                                seed=self.seed,
                                init=self.init,
                                **kwargs)
        finally:
            self.used += time.monotonic() - t0

    def __repr__(self) -> str:
        return f"Dist(world_size={self.world_size}, timeout={self.timeout:g})"
