"""Start the W rank processes of a server on this machine, and start/stop a whole server by PID.

The quick start, with no launcher dependency: each rank gets the environment torch.distributed
and DeepSpeed read (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, MASTER_ADDR, MASTER_PORT; on the CPU
DS_ACCELERATOR=cpu, since DeepSpeed's CPU accelerator reports its device count from LOCAL_SIZE).
With CUDA GPUs it starts one rank per GPU. ``torchrun`` and ``deepspeed`` start the same ranks
across nodes (docs/tinker-server/deployment.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from local_ranks import ranks
from local_ranks.procs import kill_tree

from .config import ServerConfig
from .faults import EXIT_RANK_FAILED


def cuda_device_count() -> int:
    """GPUs this machine offers torch (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def serve(world_size: int | None, config: ServerConfig, grace_s: float = 90.0) -> int:
    """Run ``world_size`` ranks until they exit; SIGTERM/SIGINT stop them through rank 0. Returns 0 after a clean
    stop, rank 0's own code if it exited with one (2: bad options), else ``EXIT_RANK_FAILED``.

    Without ``world_size``: one rank per CUDA GPU, or 2 CPU ranks where there is none (or with
    ``device="cpu"``). Rank 0 finishes the job in hand, tells the other ranks to stop, and everyone
    exits 0. When another rank dies, rank 0 fails every request for ``fault_drain_s`` and exits
    (``faults``): the other ranks are stopped at once, rank 0 once it is past its drain (or at once if
    it is the one that died). Every rank gets ``config`` whole.
    """
    device, fault_drain_s = config.device, config.fault_drain_s
    gpus = 0 if device == "cpu" else cuda_device_count()
    if device == "cuda" and not gpus:
        print("[tinker-server] --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if world_size is None:
        world_size = gpus or 2
    elif gpus and world_size > gpus:
        print(f"[tinker-server] {world_size} ranks but {gpus} GPUs: one rank per GPU (pass --device cpu for CPU "
              "ranks)", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "deepspeed_tinker", "rank", "--config-json", config.to_json()]
    # Models come from local configs; never reach for a hub.
    rank_procs = ranks.start_ranks(command, world_size, cpu=not gpus, env={"HF_HUB_OFFLINE": "1", **os.environ})
    stop_requested: list[float] = []
    failed_at: list[float] = []

    def request_stop(*_: object) -> None:
        if not stop_requested:
            stop_requested.append(time.monotonic())
            if rank_procs[0].poll() is None:
                rank_procs[0].send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    while True:
        codes = [r.poll() for r in rank_procs]
        if all(c is not None for c in codes):
            break
        if any(c not in (None, 0) for c in codes) and not failed_at:
            failed_at.append(time.monotonic())
            for r in rank_procs[1:]:  # they would wait on the dead rank forever
                if r.poll() is None:
                    kill_tree(r.pid)
        drained = failed_at and (codes[0] is not None or time.monotonic() - failed_at[0] > fault_drain_s + 30)
        overdue = stop_requested and time.monotonic() - stop_requested[0] > grace_s
        if drained or overdue:
            for r in rank_procs:
                if r.poll() is None:
                    kill_tree(r.pid)
        time.sleep(0.2)
    if not any(codes):
        return 0
    return codes[0] if codes[0] and codes[0] > 0 else EXIT_RANK_FAILED


class ServerProcess:
    """A whole server (launcher + ranks) as one child process group, stopped by PID.

    Used by the demos and the tests: ``start()`` returns once rank 0 is serving. Configured by a ``ServerConfig``
    (the demos), or by ``serve``'s command-line options (the tests: ``checkpoint_dir``, ``zero_stage`` and
    ``extra_args``).
    """

    def __init__(self, *, world_size: int = 2, config: ServerConfig | None = None, zero_stage: int = 1,
                 checkpoint_dir: Path | None = None, extra_args: list[str] | None = None,
                 log_path: Path | None = None) -> None:
        self.world_size = world_size
        self.config = config
        self.args = ["serve", "--world-size", str(world_size), "--zero-stage", str(zero_stage), "--port", "0",
                     "--checkpoint-dir", str(checkpoint_dir), *(extra_args or [])]
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.base_url = ""

    def start(self, timeout_s: float = 300.0) -> str:
        ready = Path(tempfile.mkdtemp(prefix="tinker-ready-")) / "ready.json"
        out = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "deepspeed_tinker", *self.serve_args(ready)],
                stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True)
        finally:
            if out is not None:
                out.close()  # the child has its own handle
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode} before serving")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"server not ready after {timeout_s} s")
            time.sleep(0.1)
        self.base_url = json.loads(ready.read_text())["base_url"]
        ready.unlink()
        ready.parent.rmdir()
        return self.base_url

    def serve_args(self, ready: Path) -> list[str]:
        """The ``serve`` command line that starts it, rank 0 writing ``ready`` once serving."""
        if self.config is not None:
            config = replace(self.config, ready_file=ready)
            return ["serve", "--world-size", str(self.world_size), "--config-json", config.to_json()]
        return [*self.args, "--ready-file", str(ready)]

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """SIGTERM the launcher (a clean stop); kill it and its ranks if it hangs."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        kill_tree(self.process.pid)  # and whatever ranks a launcher that did not stop cleanly left behind
        self.process.wait()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
