"""A plain-PyTorch run of what a data-parallel DeepSpeed engine computes, on one process.

Each rank computes it alone over every rank's micro-batches (data depends only on rank, step and index), so
it needs no communication: the loss of every micro-batch divided by (micro-batches per step x world size),
summed into every parameter's gradient, a zero gradient for a parameter that got none (DeepSpeed steps
every parameter it holds), clipping over the real gradients, torch's AdamW with the settings of
``training.base_config``. ``grad_hook(model, step)`` sees (and may rewrite) the reduced gradients before clipping.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import training


def run(model_fn: Callable[[], torch.nn.Module],
        plan: Sequence[int | Sequence[int]],
        world_size: int,
        clip: float = 0.0,
        prepare: Callable[[torch.nn.Module, int, int], None] | None = None,
        grad_hook: Callable[[torch.nn.Module, int], None] | None = None) -> dict[str, torch.Tensor]:
    """Parameters after one optimizer step per entry of ``plan``.

    An entry is N (micro-batches 0..N-1 of every rank) or the indices of the micro-batches the step keeps
    (the others were discarded). ``prepare(model, step, index)`` runs before each forward.
    """
    model = model_fn()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step, entry in enumerate(plan):
        indices = range(entry) if isinstance(entry, int) else list(entry)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for rank in range(world_size):
            for index in indices:
                training._CURRENT = (step, index)  # models whose control flow depends on the micro-batch
                if prepare is not None:
                    prepare(model, step, index)
                x, y = training.micro_batch(step, index, rank=rank)
                (training.loss_fn(model(x), y) / (len(indices) * world_size)).backward()
        if grad_hook is not None:
            grad_hook(model, step)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
