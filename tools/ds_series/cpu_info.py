"""py-cpuinfo's answer, asked once per process.

``cpuinfo.get_cpu_info()`` starts a Python subprocess on every call (1-1.5 s of wall time and 0.5 s of CPU on the
2-core machines CI runs on), and DeepSpeed asks it each time it builds a CPU optimizer (``DeepSpeedCPUAdam``,
``DeepSpeedCPULion``): every test with CPU optimizer offload paid that on every rank, about a quarter of the
machine during the suite. A test rank lives for many tests (ds_harness) or is forked from a server that asked
already (upstream's harness, ``cpu_info_preload``), and the CPU does not change between them: the first answer is
kept, and each caller gets its own copy of it.
"""

from __future__ import annotations

import copy
import functools
from typing import Any


def ask_cpu_info_once(now: bool = False) -> None:
    """Make ``cpuinfo.get_cpu_info`` answer from its first call's result; ``now``: make that call here (a no-op
    without py-cpuinfo)."""
    try:
        import cpuinfo
    except ImportError:
        return
    if not getattr(cpuinfo.get_cpu_info, "asked_once", False):
        first = functools.cache(cpuinfo.get_cpu_info)

        def get_cpu_info() -> dict[str, Any]:
            return copy.deepcopy(first())

        get_cpu_info.asked_once = True  # type: ignore[attr-defined]
        cpuinfo.get_cpu_info = get_cpu_info
    if now:
        cpuinfo.get_cpu_info()
