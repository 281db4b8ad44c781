#!/usr/bin/env python3
"""Record what pristine DeepSpeed 0.19.3 computes for tests/support/reference_run.py's fixed runs.

The pristine tree comes from the verified sdist (``stack.py``), is imported straight from its folder
(nothing is installed) and run on 1 and 2 gloo ranks. The digests go to
``tests/fixtures/default_behaviour.json``, which ``tests/tooling``'s default-behaviour test compares
the installed, patched DeepSpeed against.

Run: ``python tools/record_reference.py``
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "default_behaviour.json"
WORLD_SIZES = (1, 2)


def _rank(rank: int, world_size: int, port: int, tree: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    sys.path[:0] = [tree, str(ROOT / "tests")]
    import deepspeed
    from support.reference_run import CONFIGS, fixed_run

    assert deepspeed.__file__.startswith(tree), f"imported {deepspeed.__file__}, not the pristine tree"
    # DeepSpeed's CPU shared-memory all-reduce op (inference only) leaks a 64 MiB /dev/shm buffer per rank.
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    results = {name: fixed_run(name) for name in CONFIGS}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    import stack

    recorded = {"deepspeed": f"{stack.UPSTREAM_NAME}=={stack.UPSTREAM_VERSION} (pristine sdist {stack.UPSTREAM_SHA256})"}
    with tempfile.TemporaryDirectory() as tmp:
        tree = str(stack.materialize(Path(tmp) / "pristine", upto=0))
        for world_size in WORLD_SIZES:
            out = Path(tmp, f"w{world_size}")
            out.mkdir()
            mp.spawn(_rank, args=(world_size, _free_port(), tree, str(out)), nprocs=world_size)
            recorded[f"world_size_{world_size}"] = [
                json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)
            ]
    FIXTURE.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
