"""Peak memory of a window of work: resident set size on CPU, peak allocated bytes on GPU.

On Linux, writing ``5`` to ``/proc/self/clear_refs`` resets the process's peak RSS (``VmHWM`` in
``/proc/self/status``) to its current RSS, so the peak of just the measured steps can be read after
warm-up, without sampling. Where that reset is not allowed the lifetime peak is used, and the
result says so.
"""

from __future__ import annotations

import re
import resource
import sys

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as status:
            match = re.search(rf"^{field}:\s+(\d+)\s+kB", status.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def stabilize_allocator(threshold_bytes: int = 128 * 1024) -> bool:
    """Make the peak RSS track live memory: serve allocations above ``threshold_bytes`` with their own
    mappings and return freed memory to the kernel.

    By default glibc raises its mmap threshold as large blocks are freed and keeps freed heap memory,
    so the RSS of one trial depends on the order of earlier allocations and moves by a few percent
    from run to run. With a fixed threshold the peak is repeatable to about 0.1 %, at the cost of more
    page faults; :mod:`ds_bench.trial` uses it only where it measures memory, not where it times.
    Returns False where the C library has no ``mallopt`` (not glibc).
    """
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold_bytes))


def current_rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def lifetime_peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS. False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    return lifetime_peak_rss_bytes() if kib is None else kib * 1024


class PeakMemory:
    """Peak memory between :meth:`start` and :meth:`stop`, for the device the trial runs on."""

    def __init__(self, device: str):
        self.device = device
        self.window_reset = False

    def start(self) -> None:
        if self.device == "cuda":
            import torch
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.window_reset = reset_peak_rss()

    def stop(self) -> dict[str, int | None]:
        result = {
            "peak_rss_bytes": peak_rss_bytes(),
            "rss_bytes": current_rss_bytes(),
            "peak_rss_is_window": self.window_reset,
            "peak_gpu_allocated_bytes": None,
        }
        if self.device == "cuda":
            import torch
            torch.cuda.synchronize()
            result["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated()
        return result
