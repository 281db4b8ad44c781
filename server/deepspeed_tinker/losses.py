"""The built-in losses, per token, as Tinker defines them; every one is reduced by a SUM.

Each function takes the learner's ``target_logprobs`` (with grad) and the datum's inputs as
right-padded ``[B, T]`` tensors, and returns the elementwise loss; ``mask`` zeroes the padding.
``loss = elementwise.sum()`` is what ``forward_backward`` differentiates and reports as
``loss:sum``: no mean anywhere, so N requests of one step add up exactly.

- ``cross_entropy``: ``-logprob * weight``; with ``[N, K]`` targets (top-K soft targets) ``logprobs``,
  ``weights`` and the loss are ``[B, T, K]``: ``-sum_t sum_k w[t, k] * log p(x[t, k])``.
- ``importance_sampling``: ``-(ratio * advantage)`` with ``ratio = exp(logprob - sampling_logprob)``.
- ``ppo``: ``-min(ratio * A, clamp(ratio, low, high) * A)`` (thresholds are ratios, default 0.8/1.2).
- ``cispo``: ``-(clamp(ratio, low, high).detach() * A * logprob)`` (default 0.0/4.0): the clipped ratio
  is a constant coefficient, so every token keeps a gradient.
- ``dro``: ``-(logprob * A - beta / 2 * (logprob - sampling_logprob)**2)`` (``beta`` has no default).
- ``gspo`` (GSPO-token): one ratio per datum, ``s = exp(mean over the sequence_ratio_mask tokens of
  (logprob - sampling_logprob))``; every token carries ``s``'s value with its own logprob's gradient
  (``s_t = s.detach() * exp(logprob - logprob.detach())``) in ``-min(s_t * A, clamp(s_t, low, high) * A)``
  (thresholds are ratios and have no default).
- ``stable_reinforce``: Tinker does not publish its objective, only that it is a REINFORCE variant that stays
  stable off-policy using information recorded at sampling time. This server's choice is REINFORCE with a
  truncated importance weight (TIS), on the sampled tokens only: ``-(min(ratio, C).detach() * A * logprob)``
  with ``ratio`` against the sampler's recorded logprob and ``C = clip_high_threshold`` (default 2.0); the
  gradient is ``-min(ratio, C) * A * grad(logprob)``. ``weights`` (set from the provenance, ``stability.py``)
  is 1 on sampled targets and 0 on prompt ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossInputs:
    """One rank's share of a request, right-padded to ``[B, T]``."""

    targets: torch.Tensor  # int64 [B, T], or [B, T, K] when a datum has [N, K] targets
    weights: torch.Tensor  # float32, the shape of targets; 0 on padding
    sampling_logprobs: torch.Tensor  # float32; 0 where absent
    advantages: torch.Tensor  # float32; 0 where absent
    mask: torch.Tensor  # float32; 1 on real tokens, 0 on padding
    sequence_ratio_mask: torch.Tensor  # float32; 0 where absent


def _ratio(logprobs: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    # On padding both logprobs are replaced by 0 so the ratio stays finite there (and is masked out).
    return torch.exp(_log_ratio(logprobs, inputs))


def _log_ratio(logprobs: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    return torch.where(inputs.mask > 0, logprobs - inputs.sampling_logprobs, torch.zeros_like(logprobs))


def cross_entropy(logprobs: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    mask = inputs.mask.unsqueeze(-1) if logprobs.dim() == 3 else inputs.mask
    return -logprobs * inputs.weights * mask


def importance_sampling(logprobs: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    return -(_ratio(logprobs, inputs) * inputs.advantages) * inputs.mask


def ppo(logprobs: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    return _clipped_objective(_ratio(logprobs, inputs), inputs, config)


def cispo(logprobs: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    coefficient = torch.clamp(_ratio(logprobs, inputs), config["clip_low_threshold"],
                              config["clip_high_threshold"]).detach()
    return -(coefficient * inputs.advantages * logprobs) * inputs.mask


def dro(logprobs: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    penalty = 0.5 * config["beta"] * _log_ratio(logprobs, inputs)**2
    return -(logprobs * inputs.advantages - penalty) * inputs.mask


def gspo(logprobs: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    in_ratio = ((inputs.sequence_ratio_mask != 0) & (inputs.mask > 0)).float()
    # The decoder refuses a datum whose mask marks nothing; an idle rank's placeholder row has none either.
    count = in_ratio.sum(dim=1, keepdim=True).clamp(min=1.0)
    sequence_log_ratio = (_log_ratio(logprobs.detach(), inputs) * in_ratio).sum(dim=1, keepdim=True) / count
    ratio = torch.exp(sequence_log_ratio + logprobs - logprobs.detach())
    return _clipped_objective(ratio, inputs, config)


def stable_reinforce(logprobs: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    coefficient = torch.clamp(_ratio(logprobs, inputs), max=config["clip_high_threshold"]).detach()
    return -(coefficient * inputs.advantages * logprobs) * inputs.weights * inputs.mask


def _clipped_objective(ratio: torch.Tensor, inputs: LossInputs, config: dict[str, float]) -> torch.Tensor:
    """PPO's per-token ``-min(ratio * A, clamp(ratio, low, high) * A)``, masked."""
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    objective = torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages)
    return -objective * inputs.mask


ELEMENTWISE_LOSSES = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}


def elementwise_loss(loss_fn: str, logprobs: torch.Tensor, inputs: LossInputs,
                     config: dict[str, float]) -> torch.Tensor:
    """Per-token loss of ``loss_fn`` (per target for ``[N, K]`` targets); its ``.sum()`` is the request's loss."""
    return ELEMENTWISE_LOSSES[loss_fn](logprobs, inputs, config)
