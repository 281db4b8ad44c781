"""Time spent inside named methods of DeepSpeed's classes, and their calls, in the process that runs them.

``python -m ds_bench fixcost`` uses it to time the bug-fix PRs' own code (the ZeRO-3 gradient-partition
clearing, the offload boundary passes at ``step()``) and the methods they change, in the same trials that
measure the whole step, so the cost of the fixes can be read in milliseconds where the step time's noise
hides it. A target is ``"module:Class.method"``; a method the imported DeepSpeed does not have (pristine
0.19.3 has none of the fixes' new methods) is listed in :attr:`MethodTimer.absent` and not timed::

    timer = MethodTimer(["deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.step"]).install()
    before = timer.snapshot()
    engine.step()
    subtract(timer.snapshot(), before)  # {"...Stage3.step": {"calls": 1, "seconds": 0.012}}

The wrapper costs about a microsecond per call; time in a nested call of the same method counts once.
"""

from __future__ import annotations

import functools
import importlib
import time
from typing import Iterable


def parse_target(target: str) -> tuple[str, str, str]:
    """``"pkg.module:Class.method"`` -> (module, class, method)."""
    module, _, rest = target.partition(":")
    cls, _, method = rest.rpartition(".")
    if not module or not cls or not method:
        raise ValueError(f"a timed method is 'module:Class.method', got {target!r}")
    return module, cls, method


class MethodTimer:
    """Calls and wall seconds per target method, counted from :meth:`install` to :meth:`uninstall`."""

    def __init__(self, targets: Iterable[str]):
        self.targets: list[str] = list(targets)
        #: Targets whose module, class or method does not exist in the imported code.
        self.absent: list[str] = []
        self._totals: dict[str, dict[str, float]] = {}
        self._installed: list[tuple[type, str, object, bool]] = []

    def install(self) -> MethodTimer:
        for target in self.targets:
            module_name, class_name, method_name = parse_target(target)
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError):
                self.absent.append(target)
                continue
            method = getattr(cls, method_name, None)
            if not callable(method):
                self.absent.append(target)
                continue
            own = method_name in vars(cls)
            self._installed.append((cls, method_name, vars(cls).get(method_name), own))
            setattr(cls, method_name, self._wrap(target, method))
            self._totals[target] = {"calls": 0, "seconds": 0.0}
        return self

    def uninstall(self) -> None:
        for cls, name, original, own in reversed(self._installed):
            if own:
                setattr(cls, name, original)
            else:  # inherited: removing the wrapper uncovers the base class's method
                delattr(cls, name)
        self._installed = []

    def __enter__(self) -> MethodTimer:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _wrap(self, target: str, method):
        totals = self._totals
        depth = [0]

        @functools.wraps(method)
        def timed(*args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1
                entry = totals[target]
                entry["calls"] += 1
                if depth[0] == 0:
                    entry["seconds"] += time.perf_counter() - start

        return timed

    def snapshot(self) -> dict[str, dict[str, float]]:
        """A copy of the totals so far: ``{target: {"calls": n, "seconds": s}}`` for every installed target."""
        return {target: dict(entry) for target, entry in self._totals.items()}
