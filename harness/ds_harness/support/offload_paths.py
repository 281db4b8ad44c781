"""ZeRO-Offload engine configurations (`zero-offload`), in the same ``Path`` form as ``ds_harness.support.paths``.

Optimizer offload (CPU and NVMe) for ZeRO stages 1, 2 and 3, parameter offload (CPU and NVMe) for
stage 3.

``ds_harness.support.paths`` imports this module, which adds ``OFFLOAD_PATHS`` to ``ds_harness.support.paths.PATHS``,
so the shared scenarios (which look paths up by name in ``PATHS``) find them.

Optimizer offload keeps the fp32 master partition, its gradient and the optimizer state in host memory.
On the CPU accelerator "device" and host are both CPU, but the code paths (CPU accumulation buffers,
pinned buffers, the boundary-time copies into the fp32 partition) are the real ones.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .paths import CLIP, PATHS, WARMUP, Path, make_branchy_model, make_moe_model
from .training import make_model

#: Folder for NVMe offload swap files (local disk; each engine writes under its own subfolder).
NVME_PATH = os.environ.get("DS_TEST_NVME_PATH", "/tmp/ds-unmanaged-offload-nvme")

CPU_ADAM = {"optimizer": {"params": {"torch_adam": False}}}  # DeepSpeedCPUAdam, the usual offload optimizer


def _offload(stage: int,
             dtype: str = "fp32",
             *,
             model_fn=make_model,
             needs_fp16: bool = False,
             extra: dict = None,
             **offload: Any) -> Path:
    zero = {"offload_optimizer": {"device": "cpu", "pin_memory": True, **offload}}
    config = {**CLIP, **WARMUP, **(extra or {}), "zero_optimization": zero}
    return Path(stage, dtype, config, model_fn=model_fn, needs_fp16=needs_fp16)


def _with_zero(path: Path, **zero: Any) -> Path:
    extra = dict(path.extra)
    extra["zero_optimization"] = {**extra["zero_optimization"], **zero}
    return dataclasses.replace(path, extra=extra)


#: Optimizer offload for every ZeRO stage and the options that change its code path (stage 3 added below).
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


def _offload3(dtype: str = "fp32",
              *,
              model_fn=make_model,
              needs_fp16: bool = False,
              extra: dict = None,
              optimizer: dict = None,
              param: dict = None,
              **zero: Any) -> Path:
    # Persistence threshold 0 partitions (and, with offload_param, offloads) every parameter.
    zero = {"stage3_param_persistence_threshold": 0, **zero}
    if optimizer is not None:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True, **optimizer}
    if param is not None:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True, **param}
    config = {**CLIP, **WARMUP, **(extra or {}), "zero_optimization": zero}
    return Path(3, dtype, config, model_fn=model_fn, needs_fp16=needs_fp16)


# NVMe swapping: small aligned buffers for the tiny test model.
AIO = {
    "aio": {
        "block_size": 4096,
        "queue_depth": 4,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": True
    }
}
NVME = {"device": "nvme", "nvme_path": NVME_PATH}

#: ZeRO stage 3 with optimizer offload, parameter offload, both, and partial offload.
OFFLOAD_3_PATHS: dict[str, Path] = {
    "zero3-offload": _offload3(optimizer={}),
    "zero3-offload-no-pin": _offload3(optimizer={"pin_memory": False}),
    "zero3-offload-bf16": _offload3("bf16", optimizer={}),
    "zero3-offload-fp16": _offload3("fp16", needs_fp16=True, optimizer={}),
    "zero3-offload-cpu-adam": _offload3(optimizer={}, extra=CPU_ADAM),
    # two of the four 50-element sub-groups stay on the device, stepped by torch AdamW
    "zero3-offload-ratio": _offload3(optimizer={"ratio": 0.5}, extra=CPU_ADAM, sub_group_size=50),
    "zero3-offload-nvme": _offload3(optimizer=NVME, extra={
        **CPU_ADAM,
        **AIO
    }),
    "zero3-offload-param": _offload3(param={}),
    "zero3-offload-param-and-optimizer": _offload3(param={}, optimizer={}),
    "zero3-offload-param-nvme": _offload3(param={
        **NVME, "buffer_count": 8,
        "buffer_size": 4096
    },
                                          optimizer={},
                                          extra=AIO),
}
OFFLOAD_PATHS.update(OFFLOAD_3_PATHS)

#: Not in OFFLOAD_PATHS: ZeRO-3 leaks stale gradient partitions of parameters unused in some micro-batches,
#: with or without offload and in managed mode too (see test_offload_unmanaged.py).
ZERO3_OFFLOAD_BRANCHY = _offload3(model_fn=make_branchy_model, optimizer={})

#: Dynamic loss-scale fp16 offload paths, for the overflow-inside-an-accumulation tests.
OFFLOAD_FP16_DYNAMIC = ["zero1-offload-fp16", "zero2-offload-fp16", "zero3-offload-fp16"]

PATHS.update(OFFLOAD_PATHS)
