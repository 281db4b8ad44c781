"""What the ranks are asked to do: the job kinds and a typed payload for each.

Rank 0 builds a payload from a request (``api``), queues it (``scheduler``) and broadcasts it to every rank, which
runs it (``commands``, the table that says what each kind does). Payloads are frozen dataclasses, pickled to the
other ranks as they are; they hold plain values only (paths as strings), checked when the request came in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class JobKind(enum.StrEnum):
    """One kind of work on the ranks; its value is what the metrics and logs call it."""

    CREATE = "create"
    UNLOAD = "unload"
    FORWARD_BACKWARD = "forward_backward"
    FORWARD = "forward"
    OPTIM_STEP = "optim_step"
    SAVE_WEIGHTS = "save_weights"
    LOAD_WEIGHTS = "load_weights"
    SAVE_SAMPLER = "save_sampler"
    SAVE_EXTERNAL = "save_external"
    SAMPLE = "sample"
    #: Concurrent ``SAMPLE`` jobs run as one command, so they decode as one batch.
    SAMPLE_MANY = "sample_many"


@dataclass(frozen=True)
class AdamParams:
    """One ``optim_step``'s AdamW hyper-parameters and clip norm (Tinker sends them with every step)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class WeightsMeta:
    """What a checkpoint directory says about the weights in it (``tinker_meta.json``, the sampler's meta file)."""

    base_model: str
    lora: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return {"base_model": self.base_model, "lora": self.lora}


@dataclass(frozen=True)
class CheckpointRecord:
    """What rank 0 records in the checkpoint store once a save is complete on every rank."""

    run_id: str
    checkpoint_id: str
    dir: str
    ttl_seconds: int | None
    user_metadata: dict[str, Any] | None


@dataclass(frozen=True)
class SaveWeights:
    """``save_weights``: DeepSpeed's checkpoint and the weights, to ``dir``."""

    dir: str
    path: str
    overwrite: bool
    meta: WeightsMeta
    checkpoint: CheckpointRecord


@dataclass(frozen=True)
class LoadWeights:
    """``load_weights``: the weights (and with ``optimizer`` the optimizer state) of the checkpoint in ``dir``."""

    dir: str
    path: str
    optimizer: bool


@dataclass(frozen=True)
class SaveSampler:
    """``save_weights_for_sampler``: a snapshot the samplers keep as ``snapshot_id``; a named one is written to
    ``dir`` too (then ``meta`` and ``checkpoint`` are set)."""

    snapshot_id: str
    reply: dict[str, Any]
    dir: str | None = None
    meta: WeightsMeta | None = None
    checkpoint: CheckpointRecord | None = None


@dataclass(frozen=True)
class SaveExternal:
    """``save_weights_external``: the weights in Hugging Face formats to ``dir``, age-encrypted to ``recipients``."""

    dir: str
    served_name: str
    tokenizer_dir: str | None
    recipients: tuple[str, ...] | None
    reply: dict[str, Any]
    checkpoint: CheckpointRecord
