"""Direct timings of the ZeRO-1/2 offload fix's own per-step work (fix-zero-offload-stale-grads), at a size where a
pass over the fp32 gradient partition shows: 2 CPU/gloo ranks, fp32, ZeRO-1 or 2 with CPU optimizer offload, a stack
of Linear(1024, 1024) layers (96 of them: 100.8 M parameters, about 50 M fp32 gradient elements per rank).

Each step is timed in its parts: the fix's pass at ``step()`` (0.19.3: ``_finalize_offloaded_gradients()``, 0.19.8:
``_finalize_cpu_offload_gradient_accumulation()``: pending
gradients, then the clearing of the fp32 gradient slices an earlier step wrote and this one did not),
``reset_cpu_buffers()`` (its bookkeeping after the update), the whole ``step()``, and, on the same partition at the
same place (after ``reset_cpu_buffers()``), the memset of the whole fp32 gradient partition that the fix's previous
revision ran there every step. Phase "every": every layer gets a gradient in every step. Phase "missed": each step
leaves out a quarter of the layers, another quarter each step, so each step clears the slices of the quarter the
previous step used and this one missed (a quarter of the partition).

    TORCH_EXTENSIONS_DIR=.venv/torch_extensions OMP_NUM_THREADS=1 python -m ds_bench fixwork [--stage 2]

``--stage 3`` times fix-zero3-stale-grad-partitions' work instead: the pass at ``step()`` over the partitions the
boundary backward did not reach (0.19.3: ``_copy_unreached_grad_partitions_to_fp32_partitions()``, 0.19.8:
``_finalize_offload_gradient_accumulation()``) and the clearing of the gradient partitions (in host memory with
offload): the zeroing at ``step()`` of the partitions an earlier step wrote and this one did not (0.19.8:
``_zero_stale_grad_partitions()``, 0.19.3: ``_clear_stale_grad_partitions()``), with the memset of the whole flat
buffer that the fix's previous revision ran after every update timed beside it as "old memset"; where the installed
fix still runs that memset, the memset itself (``_clear_grad_partitions()``). A method the installed DeepSpeed lacks
is left out.

Run it in an environment with the fix PRs installed (``python -m ds_series.stack [--base 0.19.3] install --upto 3``
or more), with ``TORCH_EXTENSIONS_DIR`` where that environment's ops are built (tools/test.sh:
``.venv/torch_extensions``); it prints per-rank medians in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

WIDTH = 1024
#: The optimizer's methods timed per step, the fixes' own and the step around them; of each alternative (the 0.19.3
#: series' name, the 0.19.8 series'), the one the installed DeepSpeed has.
TIMED = {
    1: (("_finalize_offloaded_gradients", "_finalize_cpu_offload_gradient_accumulation"), ("reset_cpu_buffers", ),
        ("step", )),
    2: (("_finalize_offloaded_gradients", "_finalize_cpu_offload_gradient_accumulation"), ("reset_cpu_buffers", ),
        ("step", )),
    3: (("_copy_unreached_grad_partitions_to_fp32_partitions", "_finalize_offload_gradient_accumulation"),
        ("_zero_stale_grad_partitions", "_clear_stale_grad_partitions", "_clear_grad_partitions"), ("step", )),
}


def _timed(record: dict, name: str, method):

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            record.setdefault(name, []).append(time.perf_counter() - started)

    return wrapper


def _rank_body(stage: int, layers: int, steps: int) -> dict:
    import deepspeed
    import torch

    class Stack(torch.nn.Module):

        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers))
            self.skip: set = set()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, layer in enumerate(self.layers):
                if i not in self.skip:
                    x = torch.nn.functional.gelu(layer(x))
            return x.float().pow(2).mean()

    torch.manual_seed(0)
    model = Stack()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-4
            }
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {
                "device": "cpu"
            }
        },
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    optimizer = engine.optimizer
    record: dict = {}
    for names in TIMED[stage]:
        name = next((name for name in names if hasattr(optimizer, name)), None)
        if name is not None:
            setattr(optimizer, name, _timed(record, name, getattr(optimizer, name)))

    stale_clearing = any(
        hasattr(optimizer, name) for name in ("_zero_stale_grad_partitions", "_clear_stale_grad_partitions"))
    if stage == 3 and not stale_clearing:
        timed_memset = lambda: None  # noqa: E731 - _clear_grad_partitions() is ZeRO-3's memset, timed above
        elements = optimizer.grad_partitions_flat_buffer.numel()
    elif stage == 3:
        timed_memset = _timed(record, "old memset", optimizer.grad_partitions_flat_buffer.zero_)
        elements = optimizer.grad_partitions_flat_buffer.numel()
    else:

        def old_memset():
            for fp32_partition in optimizer.single_partition_of_fp32_groups:
                fp32_partition.grad.zero_()

        timed_memset = _timed(record, "old memset", old_memset)
        elements = sum(p.grad.numel() for p in optimizer.single_partition_of_fp32_groups)
    quarter = layers // 4
    results = {"gradient partition elements": elements}
    for phase in ("warm-up", "every", "missed"):
        record.clear()
        for step in range(2 if phase == "warm-up" else steps):
            model.skip = set(range((step % 4) * quarter, (step % 4 + 1) * quarter)) if phase == "missed" else set()
            x = torch.randn(2, WIDTH)
            engine.backward(engine(x))
            engine.step()
            timed_memset()  # where (and on what) the previous revision zeroed, every step
        if phase != "warm-up":
            results[phase] = {name: round(statistics.median(times) * 1e3, 3) for name, times in record.items()}
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ds_bench fixwork", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--layers", type=int, default=96, help="Linear(1024, 1024) layers (default 96: 100.8 M)")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per phase (default 8)")
    args = parser.parse_args(argv)

    from ds_harness import run_on_ranks

    per_rank = run_on_ranks(_rank_body, 2, args.stage, args.layers, args.steps, timeout=3600)
    print(json.dumps({f"rank {rank}": result for rank, result in enumerate(per_rank)}, indent=1))


if __name__ == "__main__":
    main()
