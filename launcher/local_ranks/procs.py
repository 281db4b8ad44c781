"""Stopping a process tree and removing the shared memory DeepSpeed's CPU ranks leave behind, written once.

The test harness's rank pools, the pristine reference runs, the benchmarks, the Tinker server's launcher and the
upstream-test and hunk-check runners all start ranks that can hang or be killed mid-collective; they stop them and
clean ``/dev/shm`` with these. DeepSpeed's CPU shared-memory all-reduce maps a 64 MiB
``/dev/shm/deepspeed_allreduce_buffer_*`` file per rank and process group that it never unlinks (our own ranks keep
the op out, ``local_ranks.ranks.disable_cpu_shm_allreduce``; upstream's harness does not).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

SHM = Path("/dev/shm")
#: What ranks leave there: DeepSpeed's all-reduce buffers, and the semaphores of multiprocessing's forkserver.
SHM_GLOBS = ("deepspeed_allreduce_buffer_*", "sem.mp-*")


def kill_tree(pid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL a process, every descendant psutil finds and, if it leads a process group or a session (a child
    started with ``start_new_session``), every member of those: ninja runs each compile of a JIT build in a group
    of its own, and a rank's orphans leave the tree. Waits (up to ``timeout_s``) for them to go."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    try:
        leads_group, leads_session = os.getpgid(pid) == pid, os.getsid(pid) == pid
    except ProcessLookupError:  # gone (and reaped): the group and session it led may outlive it
        leads_group = leads_session = True
    except PermissionError:
        leads_group = leads_session = False
    if leads_session:
        for other in psutil.process_iter():
            try:
                if other.pid != pid and os.getsid(other.pid) == pid:
                    procs.append(other)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
    if leads_group:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout_s)


def descendants(pid: int) -> list[int]:
    """The PIDs of a process's descendants now (empty if it is gone)."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def shm_files() -> set[str]:
    """Names of the rank leftovers (``SHM_GLOBS``) now in ``/dev/shm``."""
    return {p.name for pattern in SHM_GLOBS for p in SHM.glob(pattern)} if SHM.is_dir() else set()


def mapped_shm_files() -> set[str]:
    """Names of the ``/dev/shm`` files some live process still maps."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            for line in maps.read_text(errors="replace").splitlines():
                if "/dev/shm/" in line:
                    mapped.add(line.rsplit("/", 1)[-1].split()[0])
        except OSError:
            continue
    return mapped


def clean_shm(before: set[str]) -> int:
    """Remove the rank leftovers that appeared since ``before`` (``shm_files()`` then) and that no live process
    maps any more; returns how many. Files another user's live ranks map are left alone, and so is whatever was
    there before."""
    removed = 0
    for name in sorted(shm_files() - before - mapped_shm_files()):
        try:
            (SHM / name).unlink()
            removed += 1
        except OSError:
            pass
    return removed


def remove_group_buffers(addr: str, port: int, world_size: int) -> None:
    """Unlink the all-reduce buffers of one process group (``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``),
    once its ranks are done: for a caller that starts many groups while others still run."""
    for rank in range(world_size):
        try:
            (SHM / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}").unlink()
        except OSError:
            pass
