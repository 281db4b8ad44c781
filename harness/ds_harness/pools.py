"""Persistent rank groups, one per world size, started lazily and killed after any failure.

Starting W processes, importing torch/DeepSpeed and rendezvousing costs seconds on a
2-core machine; reusing the group across tests is what makes hundreds of engine tests fit
in CI. A group that saw an error, a death or a timeout may hold half-finished collectives,
so it is killed and the next test gets a fresh one (under ``--regressions-on-pristine``, where
every test fails by design, a group whose every rank raised is kept: see
``Settings.keep_pool_after_every_rank_raised``).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from local_ranks import ranks
from local_ranks.procs import kill_tree

from . import launch
from . import protocol as P
from .errors import PoolStartError
from .worker import BOOT, STACK_SIGNAL


class RankPool:
    """W rank processes sharing one initialised process group."""

    def __init__(self, world_size: int, backend: str, init: str) -> None:
        self.world_size = world_size
        self.backend = backend
        self.init = init
        self.dir = tempfile.mkdtemp(prefix=f"harness-w{world_size}-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        self.info: list[dict[str, Any]] = []
        self.alive = False

    def log_path(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.log")

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float) -> None:
        """Spawn the ranks and wait until each reports an initialised process group."""
        port = launch.free_port()
        for rank in range(self.world_size):
            parent_sock, child_sock = socket.socketpair()
            plumbing = {
                P.ENV_FD: str(child_sock.fileno()),
                P.ENV_BACKEND: self.backend,
                P.ENV_INIT: self.init,
                P.ENV_PARENT_PID: str(os.getpid()),
            }
            with open(self.log_path(rank), "ab") as log:
                proc = ranks.start_rank(
                    [sys.executable, "-c", BOOT],
                    rank,
                    self.world_size,
                    port,
                    cpu=self.backend != "nccl",
                    extra_env=plumbing,
                    pass_fds=[child_sock.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # own process group: killpg also takes JIT compilers etc.
                )
            child_sock.close()
            self.procs.append(proc)
            self.conns.append(Connection(parent_sock.detach()))
        self.alive = True
        self.info = [{} for _ in range(self.world_size)]
        deadline = time.monotonic() + timeout
        waiting = dict(enumerate(self.conns))
        while waiting:
            ready = wait(list(waiting.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail_start(f"ranks {sorted(waiting)} did not initialise within {timeout:.0f} s")
            for conn in ready:
                rank = self.conns.index(conn)
                del waiting[rank]
                try:
                    kind, data = conn.recv()
                except (EOFError, OSError):
                    self._fail_start(f"rank {rank} exited during start-up")
                if kind != "ready":
                    self._fail_start(f"rank {rank} failed to initialise:\n{data}")
                self.info[rank] = data

    def _fail_start(self, why: str) -> None:
        self._kill_procs()
        logs = "\n".join(f"--- rank {r} log (tail) ---\n{_tail(self.read_log(r, 0), 30)}"
                         for r in range(self.world_size))
        shutil.rmtree(self.dir, ignore_errors=True)
        raise PoolStartError(f"W={self.world_size} pool start failed: {why}\n{logs}")

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask ranks to exit; kill whatever is left after ``timeout``."""
        if not self.alive:
            return
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """Kill every rank and its children and remove the logs; the pool is unusable afterwards."""
        self._kill_procs()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_procs(self) -> None:
        """SIGKILL each rank and everything it started (keeps the logs, so they can still be read)."""
        for proc in self.procs:
            kill_tree(proc.pid)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for conn in self.conns:
            conn.close()
        self.alive = False

    # -- running -----------------------------------------------------------------------------

    def run(self, task: dict[str, Any], timeout: float, grace: float) -> list[dict[str, Any]]:
        """Send ``task`` to every rank and collect one outcome per rank.

        After the first rank that does not return normally, the others get ``grace``
        seconds (they are likely blocked in a collective with the failed rank). Ranks still
        running at the deadline get their Python stacks dumped, then the group is killed.
        """
        offsets = [self._log_size(r) for r in range(self.world_size)]
        outcomes: dict[int, dict[str, Any]] = {}
        pending: dict[int, Connection] = {}
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(task)
                pending[rank] = conn
            except OSError:
                outcomes[rank] = self._died(rank)
        start = time.monotonic()
        deadline = start + timeout
        first_bad: tuple[int, str] | None = None  # (rank, status) of the first abnormal rank
        if outcomes:
            first_bad = (min(outcomes), P.DIED)
            deadline = min(deadline, time.monotonic() + grace)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(pending.values()), timeout=remaining):
                rank = self.conns.index(conn)
                del pending[rank]
                try:
                    outcomes[rank] = conn.recv()
                except (EOFError, OSError):
                    outcomes[rank] = self._died(rank)
                if outcomes[rank]["status"] != P.OK and first_bad is None:
                    first_bad = (rank, outcomes[rank]["status"])
                    deadline = min(deadline, time.monotonic() + grace)
        stack_offsets = [self._log_size(r) for r in range(self.world_size)]
        if pending:
            self._dump_stacks(list(pending))
            for rank in pending:
                if first_bad is None:
                    outcomes[rank] = P.make_outcome(rank, P.HUNG, summary=f"still running after {timeout:g} s")
                else:
                    bad_rank, status = first_bad
                    outcomes[rank] = P.make_outcome(
                        rank, P.KILLED, summary=f"still running {grace:g} s after rank {bad_rank} reported '{status}'")
            self._kill_procs()
        result = [outcomes[r] for r in range(self.world_size)]
        for r, o in enumerate(result):
            o["output"] = self.read_log(r, offsets[r], stack_offsets[r])
            if r in pending:
                o["stack"] = self.read_log(r, stack_offsets[r])
        return result

    def _died(self, rank: int) -> dict[str, Any]:
        proc = self.procs[rank]
        try:
            code = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        how = f"exit code {code}" if code is not None and code >= 0 else f"signal {-code}" if code else "unknown"
        return P.make_outcome(rank, P.DIED, summary=f"rank process died ({how})")

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Ask hung ranks for their stacks (faulthandler) and give them a moment to write."""
        sizes = {r: self._log_size(r) for r in ranks}
        for r in ranks:
            try:
                os.kill(self.procs[r].pid, STACK_SIGNAL)
            except ProcessLookupError:
                sizes.pop(r)
        deadline = time.monotonic() + 2.0
        while sizes and time.monotonic() < deadline:
            time.sleep(0.1)
            # faulthandler writes in one burst; stop waiting once every log grew and settled.
            grown = {r: self._log_size(r) for r in sizes}
            if all(grown[r] > sizes[r] for r in sizes):
                time.sleep(0.2)
                break

    def _log_size(self, rank: int) -> int:
        try:
            return os.path.getsize(self.log_path(rank))
        except OSError:
            return 0

    def read_log(self, rank: int, start: int, end: int | None = None) -> str:
        try:
            with open(self.log_path(rank), "rb") as f:
                f.seek(start)
                data = f.read() if end is None else f.read(max(0, end - start))
        except OSError:
            return ""
        return data.decode("utf-8", errors="replace")


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


# -- registry: one live pool per world size ---------------------------------------------------

_POOLS: dict[tuple[int, str], RankPool] = {}


def resolve_init(init: str) -> str:
    """``auto`` means deepspeed.comm when DeepSpeed is installed (a broken install then fails loudly)."""
    if init == "auto":
        return "deepspeed" if importlib.util.find_spec("deepspeed") is not None else "torch"
    if init not in ("deepspeed", "torch"):
        raise ValueError(f"init must be auto, deepspeed or torch, got {init!r}")
    return init


def get_pool(world_size: int, init: str, start_timeout: float) -> RankPool:
    """The live pool for (``world_size``, ``init``), started on first use (retried once on a port race)."""
    key = (world_size, resolve_init(init))
    pool = _POOLS.get(key)
    if pool is not None and pool.alive:
        return pool
    for attempt in range(2):
        pool = RankPool(world_size, launch.backend(), key[1])
        try:
            pool.start(start_timeout)
        except PoolStartError as exc:
            if attempt == 0 and "address already in use" in str(exc).lower():
                continue
            raise
        _POOLS[key] = pool
        return pool
    raise AssertionError("unreachable")


def discard_pool(world_size: int, init: str) -> None:
    """Kill and forget the pool: it is never reused after a failure or timeout."""
    pool = _POOLS.pop((world_size, resolve_init(init)), None)
    if pool is not None:
        pool.kill()


def shutdown_pools() -> None:
    """Stop every pool (pytest session end, or interpreter exit)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.shutdown()


def live_pids(world_size: int, init: str = "auto") -> list[int]:
    """PIDs of the live pool's ranks ([] if none): lets tests check that a pool was replaced."""
    pool = _POOLS.get((world_size, resolve_init(init)))
    return [p.pid for p in pool.procs] if pool is not None and pool.alive else []


atexit.register(shutdown_pools)
