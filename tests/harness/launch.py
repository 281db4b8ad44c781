"""Backend choice and the per-rank environment, as a launcher (torchrun/deepspeed) would set it."""

from __future__ import annotations

import functools
import os
import socket


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """CUDA devices visible to the pytest process (0 on CPU machines)."""
    import torch  # deferred: collection of non-distributed tests should not pay for torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend() -> str:
    """NCCL when CUDA GPUs exist, gloo otherwise."""
    return "nccl" if gpu_count() > 0 else "gloo"


def max_world_size() -> int | None:
    """Largest world size this machine can host: one GPU per rank, unbounded on CPU."""
    n = gpu_count()
    return n if n > 0 else None


def free_port() -> int:
    """A TCP port that was free a moment ago (the pool retries if another process takes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, backend_name: str) -> dict[str, str]:
    """Environment for one rank: the variables DeepSpeed and torch.distributed read at init.

    DeepSpeed's CPU accelerator reports ``device_count()`` from LOCAL_SIZE, so it must equal
    the world size for single-node runs. DS_ACCELERATOR is forced to ``cpu`` without GPUs so
    DeepSpeed does not probe for other accelerators.
    """
    env = dict(os.environ)
    env.update({
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONUNBUFFERED": "1",  # rank output interleaves correctly with tracebacks in the log
    })
    if backend_name != "nccl":
        env["DS_ACCELERATOR"] = "cpu"
    # W ranks on few cores: one intra-op thread pool per core, not per rank, avoids oversubscription.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    return env
