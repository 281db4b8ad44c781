"""Start local ranks the way ``torchrun`` would: a free port, each rank's environment, CPU op switches.

The test harness, the benchmarks and the Tinker server all start W ranks on one machine; every rank process is
started by ``start_rank`` (``start_ranks`` for W of them), which gives it the port, the variables torch.distributed
and DeepSpeed read, and the op switches, and passes a launcher's own plumbing (the harness's socket, the benchmarks'
pipes) to ``subprocess.Popen``; so every local launch is the same launch. They stop them with ``kill_tree`` and clean
``/dev/shm`` with ``clean_shm`` (``local_ranks.procs``).
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any, Mapping, NoReturn, Sequence

MASTER_ADDR = "127.0.0.1"


def free_port() -> int:
    """A TCP port that was free a moment ago (a rendezvous that loses the race fails loudly)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((MASTER_ADDR, 0))
        return s.getsockname()[1]


def rank_env(rank: int,
             world_size: int,
             port: int | None,
             *,
             cpu: bool,
             share_cores: bool = True,
             base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one rank of a single-node job (``port`` None: the caller sets MASTER_PORT later).

    DeepSpeed's CPU accelerator reports ``device_count()`` from LOCAL_SIZE, so it must equal the world
    size; ``cpu`` forces that accelerator (DS_ACCELERATOR=cpu) instead of letting DeepSpeed probe for
    others. ``share_cores`` gives each rank its share of the cores as intra-op threads, so W ranks on a
    few cores do not each start one thread per core; under pytest-xdist the cores are shared with the other
    workers' ranks too (more OpenMP threads than cores spin against each other: steps many times slower).
    """
    env = dict(os.environ if base is None else base)
    env.update({
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": MASTER_ADDR,
        "PYTHONUNBUFFERED": "1",  # rank output interleaves with tracebacks in order
    })
    if port is not None:
        env["MASTER_PORT"] = str(port)
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    if share_cores:
        workers = int(env.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (world_size * workers))))
    return env


def start_rank(argv: Sequence[str],
               rank: int,
               world_size: int,
               port: int | None,
               *,
               cpu: bool,
               share_cores: bool = True,
               env: Mapping[str, str] | None = None,
               extra_env: Mapping[str, str] | None = None,
               **popen: Any) -> subprocess.Popen:
    """Start rank ``rank`` of ``world_size`` running ``argv``: ``rank_env(...)`` over ``env`` (default this process's),
    then ``extra_env`` (the launcher's own variables); ``popen`` goes to ``subprocess.Popen`` as it is."""
    child_env = rank_env(rank, world_size, port, cpu=cpu, share_cores=share_cores, base=env)
    child_env.update(extra_env or {})
    return subprocess.Popen(list(argv), env=child_env, **popen)


def start_ranks(argv: Sequence[str],
                world_size: int,
                *,
                cpu: bool,
                port: int | None = None,
                env: Mapping[str, str] | None = None,
                cwd: str | Path | None = None,
                log_dir: Path | None = None) -> list[subprocess.Popen]:
    """Start ``world_size`` processes running ``argv``, rank r with ``rank_env(r, ...)`` over ``env`` (default this
    process's), rendezvousing on ``port`` (default a free one); each rank's output goes to
    ``log_dir/rank<r>.log`` when given, else to this process's. Stop them with ``kill_tree(proc.pid)``."""
    port = free_port() if port is None else port
    procs = []
    for rank in range(world_size):
        log = open(log_dir / f"rank{rank}.log", "wb") if log_dir is not None else None
        try:
            procs.append(
                start_rank(argv,
                           rank,
                           world_size,
                           port,
                           cpu=cpu,
                           env=env,
                           cwd=cwd,
                           stdout=log,
                           stderr=subprocess.STDOUT if log is not None else None,
                           stdin=subprocess.DEVNULL))
        finally:
            if log is not None:
                log.close()  # the rank has its own handle
    return procs


def disable_cpu_shm_allreduce() -> None:
    """Keep DeepSpeed's CPU shared-memory all-reduce op out of gloo ranks; call before init_distributed.

    The op serves ``inference_all_reduce`` only, costs a JIT build, and maps a 64 MiB ``/dev/shm``
    buffer per rank that it never unlinks, so ranks started again and again would fill ``/dev/shm``.
    Training collectives go through gloo either way.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def init_gloo_deepspeed(timeout_minutes: float) -> None:
    """Join this process's gloo group (RANK, WORLD_SIZE, MASTER_* from the environment) and DeepSpeed's, with
    DeepSpeed's log at WARNING and its CPU shared-memory all-reduce left out (see disable_cpu_shm_allreduce)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(minutes=timeout_minutes))
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel("WARNING")
    disable_cpu_shm_allreduce()
    deepspeed.init_distributed(dist_backend="gloo")


def exit_rank(code: int = 0) -> NoReturn:
    """Leave a finished rank without interpreter teardown: C++ threads left by gloo, DeepSpeed's ops or ZeRO-3 can
    abort the process there ("terminate called without an active exception", seen in CI)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
