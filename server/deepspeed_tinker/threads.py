"""Each rank's torch intra-op thread count, from the cores the machine gives it.

torch's default is every core of the machine, in every rank: W CPU ranks on C cores then run W * C threads that
fight over C cores (a tiny training step ranged 0.12-3.3 s that way on 2 shared cores, 0.13-0.15 s with one thread
per rank). So a rank takes its share: the cores this process may run on (its CPU affinity) divided by the ranks on
this node, at least 1. ``--threads-per-rank`` overrides it; so does ``OMP_NUM_THREADS`` when set (the variable
torch itself reads), the option winning.
"""

from __future__ import annotations

import os
from typing import Mapping


def available_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or taskset's limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def local_ranks(environ: Mapping[str, str] = os.environ) -> int:
    """Ranks on this node, as the launchers say (ours and torchrun: LOCAL_WORLD_SIZE; DeepSpeed's CPU: LOCAL_SIZE)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if environ.get(name, "").isdigit() and int(environ[name]) > 0:
            return int(environ[name])
    return 1


def intra_op_threads(override: int | None, environ: Mapping[str, str] = os.environ,
                     cores: int | None = None) -> tuple[int, str]:
    """(threads, why) for this rank."""
    if override is not None:
        return override, "--threads-per-rank"
    omp = environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    cores = available_cores() if cores is None else cores
    ranks = local_ranks(environ)
    return max(1, cores // ranks), f"{cores} cores / {ranks} local ranks"
