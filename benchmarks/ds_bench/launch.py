"""Start W rank hosts (:mod:`ds_bench.worker`) and run trials on all of them at once.

Every trial gets a fresh port and a fresh forked process per rank. If one rank fails, or a trial
outlives its timeout, the launcher kills that trial's children (by their process ids) so no rank is
left waiting in a collective, and reports the failure with the ranks' errors.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from local_ranks.procs import kill_tree, remove_group_buffers
from local_ranks.ranks import MASTER_ADDR, free_port, start_rank

ROOT = Path(__file__).resolve().parents[2]


class LaunchError(RuntimeError):
    """A rank host died or did not answer in time."""


class _Host:
    """One rank host process and a thread that queues the JSON lines it prints."""

    def __init__(self, rank: int, world_size: int, device: str, preload: list[str], log_path: Path, env: dict):
        self.rank = rank
        self.log_path = log_path
        self.log = open(log_path, "w")
        # Each trial sets MASTER_PORT. Torch's default thread count, as in the committed measurements.
        base = {**os.environ, **env}
        if device != "cpu":
            # Let the host ask whether CUDA exists without creating a CUDA context its forked trials inherit.
            base.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        command = [sys.executable, "-m", "ds_bench.worker"]
        if preload:
            command += ["--preload", ",".join(preload)]
        self.process = start_rank(command,
                                  rank,
                                  world_size,
                                  None,
                                  cpu=device == "cpu",
                                  share_cores=False,
                                  env=base,
                                  stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE,
                                  stderr=self.log,
                                  cwd=str(ROOT),
                                  text=True,
                                  bufsize=1)
        self.lines: queue.Queue[dict | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.child_pid: int | None = None

    def _read(self) -> None:
        for line in self.process.stdout:
            line = line.strip()
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def next(self, deadline: float) -> dict:
        try:
            message = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise LaunchError(f"rank {self.rank} did not answer in time; see {self.log_path}") from None
        if message is None:
            raise LaunchError(f"rank {self.rank} host exited with {self.process.wait()}; see {self.log_path}")
        return message

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill_child(self) -> None:
        if self.child_pid is not None:
            try:
                os.kill(self.child_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class RankPool:
    """W rank hosts that run trials together. Use as a context manager."""

    def __init__(self,
                 world_size: int,
                 device: str = "cpu",
                 preload: list[str] | None = None,
                 log_dir: Path | None = None,
                 start_timeout_s: float = 1800.0,
                 env: dict | None = None):
        self.world_size = world_size
        self.device = device
        self.preload = list(preload or [])
        self.start_timeout_s = start_timeout_s
        self.env = dict(env or {})
        self._tmp = tempfile.TemporaryDirectory(prefix="ds-bench-")
        self.log_dir = Path(log_dir) if log_dir else Path(self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.hosts: list[_Host] = []
        #: {op: reason} for the preloaded ops that could not be built on this machine.
        self.preload_errors: dict = {}
        #: The DeepSpeed each rank host imported: ``[{"version": ..., "file": ...}]`` by rank.
        self.deepspeed: list[dict] = []
        self._ids = itertools.count()

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self.hosts = [
            _Host(rank, self.world_size, self.device, self.preload, self.log_dir / f"rank{rank}.log", self.env)
            for rank in range(self.world_size)
        ]
        deadline = time.monotonic() + self.start_timeout_s
        for host in self.hosts:
            message = host.next(deadline)
            if not message.get("ready"):
                raise LaunchError(f"rank {host.rank} host sent {message} instead of ready")
            self.preload_errors.update(message.get("preload_errors") or {})
            self.deepspeed.append(message.get("deepspeed") or {})

    def close(self) -> None:
        for host in self.hosts:
            host.kill_child()
            try:
                host.send({"quit": True})
                host.process.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        for host in self.hosts:
            try:
                host.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_tree(host.process.pid)
                host.process.wait()
            host.log.close()
        self.hosts = []
        self._tmp.cleanup()

    def run(self, spec: dict, timeout_s: float) -> list[dict]:
        """Run one trial on every rank; return the ranks' results, or raise LaunchError with their errors."""
        trial_id = next(self._ids)
        port = free_port()
        outs = [self.log_dir / f"trial{trial_id}.rank{host.rank}.json" for host in self.hosts]
        for host, out in zip(self.hosts, outs):
            host.child_pid = None
            host.send({"id": trial_id, "port": port, "spec": spec, "out": str(out)})
        deadline = time.monotonic() + timeout_s
        exits = {}
        failure = None
        try:
            for host in self.hosts:
                host.child_pid = host.next(deadline)["pid"]
            pending = list(self.hosts)
            while pending:
                for host in list(pending):
                    try:
                        message = host.lines.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    if message is None:
                        raise LaunchError(f"rank {host.rank} host exited; see {host.log_path}")
                    exits[host.rank] = message["exit"]
                    host.child_pid = None
                    pending.remove(host)
                    if message["exit"] != 0 and failure is None:
                        failure = f"rank {host.rank} exited with {message['exit']}"
                        # Its peers may wait in a collective for it: give them a moment, then end them.
                        deadline = min(deadline, time.monotonic() + 10)
                if pending and time.monotonic() > deadline:
                    failure = failure or f"trial timed out after {timeout_s:.0f} s"
                    for host in pending:
                        host.kill_child()
                    for host in pending:
                        host.next(time.monotonic() + 30)
                        host.child_pid = None
                    pending = []
        finally:
            for host in self.hosts:
                host.kill_child()
            # DeepSpeed 0.19.3's shm comm op leaves about 66 MB per rank and process group; each trial has its port.
            remove_group_buffers(MASTER_ADDR, port, self.world_size)
        results = []
        for host, out in zip(self.hosts, outs):
            try:
                results.append(json.loads(out.read_text()))
                out.unlink()
            except (OSError, ValueError):
                code = exits.get(host.rank)
                how = "was killed" if code is None else (
                    f"died of signal {signal.Signals(-code).name}" if code < 0 else f"exited with {code}")
                tail = host.log_tail(3).strip().splitlines()
                reason = f": {tail[-1].strip()[:300]}" if tail else ""
                results.append({
                    "status": "error",
                    "error": f"rank {host.rank} {how} without a result{reason}",
                    "log": host.log_tail()
                })
        if failure and all(r["status"] == "ok" for r in results):
            raise LaunchError(failure)
        return results
