"""py-cpuinfo's answer, asked once per process.

``cpuinfo.get_cpu_info()`` starts a Python subprocess on every call (1-1.5 s of wall time and 0.5 s of CPU on the
2-core machines CI runs on), and DeepSpeed asks it each time it builds a CPU optimizer (``DeepSpeedCPUAdam``,
``DeepSpeedCPULion``): every test with CPU optimizer offload paid that on every rank, about a quarter of the
machine during the suite. A test rank lives for many tests (ds_harness) or is forked from a server that asked
already (upstream's harness, ``cpu_info_preload``), and the CPU does not change between them.

The subprocess's JSON answer (``cpuinfo.cpuinfo.get_cpu_info_json``, which ``get_cpu_info`` looks up when called)
is kept, not ``get_cpu_info`` itself: callers that bound ``get_cpu_info`` at import, before this ran (0.19.3's
``cpu_adam`` does), are served too, and each call still parses its own dict.
"""

from __future__ import annotations

import functools
import importlib


def ask_cpu_info_once(now: bool = False) -> None:
    """Make py-cpuinfo answer every later call from its first one; ``now``: make that call here (a no-op without
    py-cpuinfo)."""
    try:
        module = importlib.import_module("cpuinfo.cpuinfo")
    except ImportError:
        return
    if not getattr(module.get_cpu_info_json, "asked_once", False):
        module.get_cpu_info_json = functools.cache(module.get_cpu_info_json)
        module.get_cpu_info_json.asked_once = True
    if now:
        module.get_cpu_info_json()
