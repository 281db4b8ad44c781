"""The built-in losses, per token, as Tinker defines them; every one is reduced by a SUM.

Each function takes the learner's ``target_logprobs`` (with grad) and the datum's inputs as
right-padded ``[B, T]`` tensors, and returns the elementwise loss; ``mask`` zeroes the padding.
``loss = elementwise.sum()`` is what ``forward_backward`` differentiates and reports as
``loss:sum``: no mean anywhere, so N requests of one step add up exactly.

- ``cross_entropy``: ``-logprob * weight``.
- ``importance_sampling``: ``-(ratio * advantage)`` with ``ratio = exp(logprob - sampling_logprob)``.
- ``ppo``: ``-min(ratio * A, clamp(ratio, low, high) * A)`` (thresholds are ratios, default 0.8/1.2).
- ``cispo``: ``-(clamp(ratio, low, high).detach() * A * logprob)`` (default 0.0/4.0): the clipped ratio
  is a constant coefficient, so every token keeps a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossInputs:
    """One rank's share of a request, right-padded to ``[B, T]``."""

    targets: torch.Tensor  # int64
    weights: torch.Tensor  # float32; 0 on padding
    sampling_logprobs: torch.Tensor  # float32; 0 where absent
    advantages: torch.Tensor  # float32; 0 where absent
    mask: torch.Tensor  # float32; 1 on real tokens, 0 on padding


def _ratio(logprobs: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    # On padding both logprobs are replaced by 0 so the ratio stays finite there (and is masked out).
    delta = torch.where(inputs.mask > 0, logprobs - inputs.sampling_logprobs, torch.zeros_like(logprobs))
    return torch.exp(delta)


def cross_entropy(logprobs: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    return -logprobs * inputs.weights * inputs.mask


def importance_sampling(logprobs: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    return -(_ratio(logprobs, inputs) * inputs.advantages) * inputs.mask


def ppo(logprobs: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    ratio = _ratio(logprobs, inputs)
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    objective = torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages)
    return -objective * inputs.mask


def cispo(logprobs: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    coefficient = torch.clamp(_ratio(logprobs, inputs), config["clip_low_threshold"],
                              config["clip_high_threshold"]).detach()
    return -(coefficient * inputs.advantages * logprobs) * inputs.mask


ELEMENTWISE_LOSSES = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
}


def elementwise_loss(loss_fn: str, logprobs: torch.Tensor, inputs: LossInputs,
                     config: dict[str, float]) -> torch.Tensor:
    """Per-token loss of ``loss_fn``; its ``.sum()`` is the request's loss."""
    return ELEMENTWISE_LOSSES[loss_fn](logprobs, inputs, config)
