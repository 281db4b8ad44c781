"""Backend choice for the harness's ranks (their environment and start: ``local_ranks.ranks``)."""

from __future__ import annotations

import functools

from local_ranks.ranks import free_port  # noqa: F401 - the harness's port source


@functools.cache
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
