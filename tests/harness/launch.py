"""Backend choice and the per-rank environment, as a launcher (torchrun/deepspeed) would set it."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the shared launch helpers live in the repository's examples/
    sys.path.insert(0, str(ROOT))

from examples import ranks  # noqa: E402
from examples.ranks import free_port  # noqa: E402,F401 - the harness's port source


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


def rank_env(rank: int, world_size: int, port: int, backend_name: str) -> dict[str, str]:
    """Environment for one rank (``examples/ranks.py``), with the repository importable on the rank."""
    env = ranks.rank_env(rank, world_size, port, cpu=backend_name != "nccl")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env
