"""Trials in different rank pools that take their steps in turn: one step of one pool at a time.

``python -m ds_bench fixcost`` compares DeepSpeed builds, and a process imports one DeepSpeed, so each build
has its own pool of rank hosts (:class:`ds_bench.launch.RankPool`). To compare them step by step, as the main
benchmark's timing trial compares engines of one process, the launcher starts one trial on every pool at once and
a :class:`Conductor` hands out the turns: before each logical step, rank 0 of a trial waits for its turn
(:class:`Turns`), the trial's ranks meet in a barrier, run the step, meet again, and rank 0 reports the step done;
only then does the next pool get a turn. So only one pool computes at any time, and the step times of the
different builds are neighbours in time, measured under the same load.

The protocol is one TCP connection per trial, from its rank 0 to the launcher: the trial sends its role and a
newline, then for every step the launcher sends ``g`` and the trial answers ``d``. A closed connection on either
side ends the lockstep: the trial raises (its ranks then fail their barrier and exit), the launcher reports it.
"""

from __future__ import annotations

import socket
import time
from typing import Callable, Dict, Iterable, List, Optional

from ds_harness.ranks import MASTER_ADDR

GO = b"g"
DONE = b"d"


class LockstepError(RuntimeError):
    """A trial did not connect, or left the lockstep (its process ended or timed out)."""


class Turns:
    """The trial's side: rank 0 of a trial waits for its turn before each step and reports after it.

    ``address`` is the spec's ``lockstep`` entry (``{"port": ..., "role": ...}``); without one, or on ranks other
    than 0, every call returns at once.
    """

    def __init__(self, address: Optional[dict], rank: int, timeout_s: float):
        self.sock: Optional[socket.socket] = None
        if address is not None and rank == 0:
            self.sock = socket.create_connection((MASTER_ADDR, address["port"]), timeout=timeout_s)
            self.sock.sendall(f"{address['role']}\n".encode())

    def wait(self) -> None:
        if self.sock is not None and self.sock.recv(1) != GO:
            raise LockstepError("the launcher ended the lockstep")

    def done(self) -> None:
        if self.sock is not None:
            self.sock.sendall(DONE)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


class Conductor:
    """The launcher's side: accepts one connection per role, then gives the roles their turns."""

    def __init__(self, roles: Iterable[str], timeout_s: float):
        self.roles: List[str] = list(roles)
        self.timeout_s = timeout_s
        self.server = socket.create_server((MASTER_ADDR, 0))
        self.port: int = self.server.getsockname()[1]
        self.connections: Dict[str, socket.socket] = {}

    def address(self, role: str) -> dict:
        """The spec entry (``lockstep``) of the trial that plays ``role``."""
        return {"port": self.port, "role": role}

    def accept(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Wait until every role has connected; raise if ``alive()`` turns false (a trial ended) or on timeout."""
        deadline = time.monotonic() + self.timeout_s
        self.server.settimeout(0.5)
        while len(self.connections) < len(self.roles):
            if not alive():
                raise LockstepError(f"a trial ended before the lockstep began (connected: {sorted(self.connections)})")
            if time.monotonic() > deadline:
                raise LockstepError(f"trials did not connect within {self.timeout_s:.0f} s "
                                    f"(connected: {sorted(self.connections)})")
            try:
                conn, _ = self.server.accept()
            except socket.timeout:
                continue
            conn.settimeout(self.timeout_s)
            role = _read_line(conn)
            if role not in self.roles or role in self.connections:
                conn.close()
                raise LockstepError(f"unexpected lockstep role {role!r}")
            self.connections[role] = conn

    def turn(self, role: str) -> None:
        """Let ``role``'s trial take one step and wait until it has."""
        conn = self.connections[role]
        try:
            conn.sendall(GO)
            answer = conn.recv(1)
        except OSError as error:
            raise LockstepError(f"{role}: {type(error).__name__}: {error}") from None
        if answer != DONE:
            raise LockstepError(f"{role}'s trial left the lockstep")

    def run(self, steps: int, order: Callable[[int], List[str]]) -> None:
        """``steps`` turns of every role, in ``order(step)`` at each step."""
        for step in range(steps):
            for role in order(step):
                self.turn(role)

    def close(self) -> None:
        for conn in self.connections.values():
            conn.close()
        self.connections = {}
        self.server.close()
