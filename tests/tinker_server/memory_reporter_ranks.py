"""One rank of ``test_memory_reporter.py``: ``python tests/tinker_server/memory_reporter_ranks.py OUT_DIR STEPS``
with the launcher environment set. The server's ``Worker`` trains a LoRA client of the tiny byte-level Llama at
ZeRO-0 (``forward_backward`` + ``optim_step``, STEPS times, a barrier between steps as the server's collectives
between commands) while the server's memory reporter reads the engines' tensors as often as it gets the chance
(every 0 s, not every 2). Each rank writes ``OUT_DIR/rank<r>.json``: its steps and its
last memory report."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def main(out_dir: Path, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from local_ranks.ranks import init_gloo_deepspeed

    init_gloo_deepspeed(timeout_minutes=10)
    from deepspeed_tinker.api import ModelRecord, _adam_params
    from deepspeed_tinker.commands import run_command
    from deepspeed_tinker.jobs import JobKind
    from deepspeed_tinker.metrics import MEMORY_KEY, start_memory_reporter
    from deepspeed_tinker.model import LoraSpec
    from deepspeed_tinker.wire import Datum, FwdBwdRequest
    from deepspeed_tinker.worker import Worker

    torch.set_num_threads(1)
    rank = dist.get_rank()
    worker = Worker(rank, dist.get_world_size(), 0)
    run_command(worker, JobKind.CREATE, "m", ModelRecord("m", "s", "tiny-llama-byte", LoraSpec(rank=4, seed=0)))
    start_memory_reporter(worker, every_s=0.0)
    rng = np.random.default_rng(rank)
    data = []
    for _ in range(4):
        tokens = rng.integers(0, 250, 33).astype(np.int64)
        data.append(Datum(tokens[:-1], tokens[1:], np.ones(32, np.float32)))
    request = FwdBwdRequest("m", 1, "cross_entropy", False, tuple(data))
    adam = _adam_params({"adam_params": {"learning_rate": 1e-4}})
    for _ in range(steps):
        run_command(worker, JobKind.FORWARD_BACKWARD, "m", request)
        run_command(worker, JobKind.OPTIM_STEP, "m", adam)
        dist.barrier()  # as the server's broadcast and gather do between commands: the reporter's turn
    report = json.loads(dist.distributed_c10d._get_default_store().get(MEMORY_KEY.format(rank=rank)))
    seen = {"steps": worker.models["m"].steps, "report": report, "now": time.time()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    os._exit(0)  # the reporter thread is a daemon in a store call; no interpreter teardown under it


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
