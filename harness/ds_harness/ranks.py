"""Start local ranks the way ``torchrun`` would: a free port, each rank's environment, CPU op switches.

The examples, the benchmarks and the test harness all start W ranks on one machine; they take the port,
the variables torch.distributed and DeepSpeed read, and the op switches from here so that every local
launch is the same launch.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping, NoReturn

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
    few cores do not each start one thread per core.
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
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    return env


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
