"""ZeRO-Offload engine configurations (PR 4), in the same ``Path`` form as ``support.paths``.

``OFFLOAD_PATHS`` is meant to be merged into ``support.paths.PATHS``; until it is, importing this module
registers it there, so the shared scenarios (which look paths up by name in ``PATHS``) find them.

Optimizer offload keeps the fp32 master partition, its gradient and the optimizer state in host memory.
On the CPU accelerator "device" and host are both CPU, but the code paths (CPU accumulation buffers,
pinned buffers, the boundary-time copies into the fp32 partition) are the real ones.
"""

from __future__ import annotations

import os
from typing import Any

from .paths import CLIP, PATHS, WARMUP, Path, make_branchy_model, make_moe_model
from .training import make_model

#: Folder for NVMe offload swap files (local disk; each engine writes under its own subfolder).
NVME_PATH = os.environ.get("DS_TEST_NVME_PATH", "/tmp/ds-unmanaged-offload-nvme")

CPU_ADAM = {"optimizer": {"params": {"torch_adam": False}}}  # DeepSpeedCPUAdam, the usual offload optimizer


def _offload(stage: int, dtype: str = "fp32", *, model_fn=make_model, needs_fp16: bool = False, extra: dict = None,
             **offload: Any) -> Path:
    zero = {"offload_optimizer": {"device": "cpu", "pin_memory": True, **offload}}
    return Path(stage, dtype, {**CLIP, **WARMUP, **(extra or {}), "zero_optimization": zero},
                model_fn=model_fn,
                needs_fp16=needs_fp16)


def _with_zero(path: Path, **zero: Any) -> Path:
    extra = dict(path.extra)
    extra["zero_optimization"] = {**extra["zero_optimization"], **zero}
    return Path(path.stage, path.dtype, extra, path.kwargs, path.model_fn, path.needs_fp16)


#: Optimizer offload for ZeRO stages 1 and 2 and the options that change its code path.
OFFLOAD_PATHS: dict[str, Path] = {
    "zero1-offload": _offload(1),
    "zero1-offload-no-pin": _offload(1, pin_memory=False),
    "zero1-offload-bf16": _offload(1, "bf16"),
    "zero1-offload-fp16": _offload(1, "fp16", needs_fp16=True),
    "zero1-offload-cpu-adam": _offload(1, extra=CPU_ADAM),
    "zero1-offload-branchy": _offload(1, model_fn=make_branchy_model),
    "zero2-offload": _offload(2),
    "zero2-offload-no-pin": _offload(2, pin_memory=False),
    "zero2-offload-bf16": _offload(2, "bf16"),
    "zero2-offload-fp16": _offload(2, "fp16", needs_fp16=True),
    "zero2-offload-cpu-adam": _offload(2, extra=CPU_ADAM),
    "zero2-offload-branchy": _offload(2, model_fn=make_branchy_model),
    "zero2-offload-moe": _offload(2, model_fn=make_moe_model),
    "zero2-offload-overlap-comm": _with_zero(_offload(2), overlap_comm=True),
    "zero2-offload-small-buckets": _with_zero(_offload(2), reduce_bucket_size=40, allgather_bucket_size=64),
    "zero2-offload-nvme": _offload(2, device="nvme", nvme_path=NVME_PATH),
}

#: Dynamic loss-scale fp16 offload paths, for the overflow-inside-an-accumulation tests.
OFFLOAD_FP16_DYNAMIC = ["zero1-offload-fp16", "zero2-offload-fp16"]

PATHS.update(OFFLOAD_PATHS)
