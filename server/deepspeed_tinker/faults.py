"""A rank that dies ends every request in an error the SDK raises, not in a hang.

The SDK retries connection errors and 5xx answers (for hours), but raises ``RequestFailedError`` as soon as
``retrieve_future`` answers a failed result with a category. So rank 0 must notice the death itself, while it
still serves HTTP, and fail the futures; then it exits, since the process group has lost a member for good.

- ``PeerWatch``: every other rank holds a TCP connection to rank 0 and sends a byte every ``HEARTBEAT_S``. A
  process that dies has its sockets closed by the kernel, so rank 0 sees the end of the stream at once, whatever
  its own main thread is doing (idle, or blocked in a collective with the dead rank, which gloo may report and
  NCCL never does); a rank that goes silent for ``timeout_s`` (a hung or unreachable node) counts as dead too.
  A follower that loses rank 0 exits on its own, so no rank waits a day in a broadcast.
- ``FaultDrain``: on the first fault (a dead peer, or a collective that raised) every pending future fails with a
  ``server`` error naming the cause, and so does every request that arrives in the next ``drain_s`` seconds (the
  future store fails them at birth); then rank 0 exits with ``EXIT_RANK_FAILED``, from its own thread, since the
  main thread may be stuck in a collective that never returns. Nothing in the drain touches the process group.
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import socket
import threading
import time
from typing import Callable

log = logging.getLogger("tinker_server")

#: Exit code of a rank (and of ``serve``) after a rank died or a collective failed.
EXIT_RANK_FAILED = 3
#: Defaults of ``--fault-drain-s`` and ``--peer-timeout-s``.
DEFAULT_DRAIN_S = 20.0
DEFAULT_PEER_TIMEOUT_S = 60.0
HEARTBEAT_S = 1.0
#: How long a follower that lost rank 0 waits before exiting (a clean stop finishes well within it).
FOLLOWER_GRACE_S = 30.0


class PeerWatch:
    """Rank 0's watch over the other ranks' liveness (see the module docstring)."""

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_PEER_TIMEOUT_S) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.token = secrets.token_hex(16)
        # All interfaces, like torch.distributed's own store: the followers reach rank 0 at MASTER_ADDR.
        self._listener = socket.create_server(("", 0))
        self._peers: dict[socket.socket, int] = {}
        self._armed = threading.Event()
        self._closed = False

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def accept(self, timeout_s: float = 300.0) -> None:
        """Take every follower's connection (each says the token and its rank)."""
        deadline = time.monotonic() + timeout_s
        while len(self._peers) < self.world_size - 1:
            self._listener.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                raise RuntimeError(f"only {len(self._peers)} of {self.world_size - 1} ranks connected to rank 0's "
                                   f"liveness watch within {timeout_s:g} s") from None
            conn.settimeout(10.0)
            try:
                line = conn.makefile("rb").readline(128).decode(errors="replace").split()
            except OSError:
                line = []
            if len(line) != 2 or not secrets.compare_digest(line[0], self.token) or not line[1].isdigit():
                conn.close()  # not one of ours
                continue
            conn.settimeout(None)
            self._peers[conn] = int(line[1])
        self._listener.close()

    def start(self, on_fault: Callable[[str], None]) -> None:
        """Watch from a daemon thread; ``on_fault(reason)`` once, for the first rank found dead."""
        self._armed.set()
        threading.Thread(target=self._watch, args=(on_fault, ), name="tinker-peer-watch", daemon=True).start()

    def disarm(self) -> None:
        """A clean stop: the followers are about to exit, which is no fault."""
        self._armed.clear()

    def _watch(self, on_fault: Callable[[str], None]) -> None:
        selector = selectors.DefaultSelector()
        heard = {}
        for conn, rank in self._peers.items():
            selector.register(conn, selectors.EVENT_READ, rank)
            heard[rank] = time.monotonic()
        while self._armed.is_set():
            for key, _ in selector.select(timeout=HEARTBEAT_S):
                rank = key.data
                try:
                    data = key.fileobj.recv(4096)  # type: ignore[union-attr]
                except OSError as e:
                    data, why = b"", f"its connection failed ({e})"
                else:
                    why = "its process exited (its connection to rank 0 closed)"
                if not data:
                    if self._armed.is_set():
                        on_fault(f"rank {rank} died: {why}")
                    return
                heard[rank] = time.monotonic()
            silent = [(rank, time.monotonic() - at) for rank, at in heard.items()
                      if time.monotonic() - at > self.timeout_s]
            if silent and self._armed.is_set():
                rank, quiet = silent[0]
                on_fault(f"rank {rank} sent no heartbeat for {quiet:.0f} s (--peer-timeout-s {self.timeout_s:g}): "
                         "hung or unreachable")
                return


def heartbeat(host: str, port: int, token: str, rank: int) -> None:
    """A follower: connect to rank 0's watch and keep it told that this rank lives; exit once rank 0 is gone."""
    conn = socket.create_connection((host, port), timeout=60)
    conn.sendall(f"{token} {rank}\n".encode())

    def beat() -> None:
        try:
            while True:
                time.sleep(HEARTBEAT_S)
                conn.sendall(b".")
        except OSError as e:
            reason = str(e)
        # Rank 0 is gone: a clean stop has told this rank to exit already (it finishes within the grace); otherwise
        # this rank would wait in the next broadcast for a day.
        time.sleep(FOLLOWER_GRACE_S)
        print(f"[tinker-server] rank {rank}: rank 0 is gone ({reason}); exiting with code {EXIT_RANK_FAILED}",
              flush=True)
        os._exit(EXIT_RANK_FAILED)

    threading.Thread(target=beat, name="tinker-heartbeat", daemon=True).start()


class FaultDrain:
    """Rank 0 after a fault: fail what is pending and what comes in for ``drain_s`` seconds, then exit."""

    def __init__(self, fail_all: Callable[[str, str], int], stop: Callable[[], None], drain_s: float,
                 finish: Callable[[], None]) -> None:
        self._fail_all = fail_all
        self._stop = stop
        self.drain_s = drain_s
        self._finish = finish
        self._lock = threading.Lock()
        self.reason: str | None = None
        self.message = ""

    @property
    def tripped(self) -> bool:
        return self.reason is not None

    def trip(self, reason: str) -> None:
        """The first call fails every pending and new request and starts the drain; later calls do nothing."""
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
        self.message = (f"server fault, shutting down: {reason}. Every unfinished request fails; the server exits and "
                        "must be restarted on the same --checkpoint-dir, and training resumed from the last "
                        "save_state (create_training_client_from_state_with_optimizer)")
        failed = self._fail_all(self.message, "server")
        print(f"[tinker-server] FAULT: {reason}; failed {failed} pending request(s); answering new requests with "
              f"the error for {self.drain_s:g} s (--fault-drain-s), then exiting with code {EXIT_RANK_FAILED}",
              flush=True)
        self._stop()
        threading.Thread(target=self._drain_then_exit, name="tinker-fault-drain", daemon=True).start()

    def _drain_then_exit(self) -> None:
        time.sleep(self.drain_s)
        try:
            self._finish()
        except Exception:  # exiting regardless: the group is gone
            log.exception("rank 0: clean-up after a fault")
        print(f"[tinker-server] stopped after a fault (exit code {EXIT_RANK_FAILED})", flush=True)
        from local_ranks.ranks import exit_rank

        exit_rank(EXIT_RANK_FAILED)

    def wait(self) -> None:
        """The main thread, once out of the job loop: block until the drain thread exits the process."""
        threading.Event().wait()
