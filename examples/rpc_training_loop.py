"""An RPC-style training loop on 2 CPU ranks: the caller, not DeepSpeed, owns the accumulation boundary.

Each logical step receives a random number N of micro-batches (as an RPC/HTTP training server receives
N ``forward_backward`` requests), calls ``engine.backward()`` once per micro-batch and ``engine.step()``
once. Beside it, a managed engine is driven through the same data with today's workaround
(``set_gradient_accumulation_boundary()`` toggled around every backward); after each step the demo
prints the loss and whether the two engines' parameters are bitwise identical.

Run: ``python examples/rpc_training_loop.py [--steps 6] [--world-size 2]``
"""

from __future__ import annotations

import argparse
import os
import random

import torch
import torch.multiprocessing as mp

from local_ranks.ranks import disable_cpu_shm_allreduce, exit_rank, free_port, rank_env

MICRO_BATCH = 4
FEATURES = 16


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))


def make_engine(managed: bool):
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "managed_gradient_accumulation": managed,
        "steps_per_print": 1_000_000,
    }
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def micro_batch(step: int, index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic regression data, different on every rank."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * index + rank)
    x = torch.randn(MICRO_BATCH, FEATURES, generator=g)
    return x, x[:, :1] * 2.0 - x[:, 1:2]


def rank_main(rank: int, world_size: int, port: int, steps: int) -> None:
    os.environ.update(rank_env(rank, world_size, port, cpu=True))
    import deepspeed
    from deepspeed.utils import logger
    logger.setLevel("WARNING")
    disable_cpu_shm_allreduce()
    deepspeed.init_distributed(dist_backend="gloo")

    unmanaged, managed = make_engine(managed=False), make_engine(managed=True)
    if rank == 0:
        print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, {world_size} ranks")
    plan = random.Random(0)
    for step in range(steps):
        n = plan.randint(1, 5)  # chosen by the client, per step
        losses = []
        for i in range(n):
            x, y = micro_batch(step, i, rank)
            # Mean over the step's micro-batches: each loss is divided by N, not by the configured GAS.
            loss = torch.nn.functional.mse_loss(unmanaged(x), y) / n
            unmanaged.backward(loss, scale_wrt_gas=False)
            losses.append(loss.item() * n)

            managed.set_gradient_accumulation_boundary(i == n - 1)
            managed.backward(torch.nn.functional.mse_loss(managed(x), y) / n, scale_wrt_gas=False)
            managed.step()
        unmanaged.step()

        same = all(
            torch.equal(a, b) for a, b in zip(unmanaged.module.parameters(), managed.module.parameters()))
        mean_loss = torch.tensor(sum(losses) / n)
        deepspeed.comm.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {step}: N={n} backward passes, loss {mean_loss.item() / world_size:.5f}, "
                  f"parity with managed mode: {'bitwise' if same else 'DIFFERENT'}")
        if not same:
            raise SystemExit(f"rank {rank}: unmanaged and managed engines diverged at step {step}")
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()
    exit_rank(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    mp.spawn(rank_main, args=(args.world_size, free_port(), args.steps), nprocs=args.world_size)


if __name__ == "__main__":
    main()
