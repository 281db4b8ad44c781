"""The command table: for each job kind, how rank 0 prepares it, how every rank runs it, how rank 0 merges the
ranks' parts into one result, and what rank 0 records once it succeeded (before its future resolves, so what is
acknowledged is durable), with what the metrics count of it.

``server`` drives (rank 0) and follows (the other ranks) through this table without knowing any kind; the
``Worker`` keeps the engine methods the table calls; ``metrics`` reads each kind's tokens and step role here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from .jobs import CheckpointRecord, JobKind
from .sampling import merge_samples
from .wire import FwdBwdResult

if TYPE_CHECKING:
    from .worker import Worker


class Recorder(Protocol):
    """What rank 0 records around jobs (the API's checkpoint store and run list)."""

    def record_run(self, record: Any) -> None:
        """A training model was created: list its run."""

    def record_checkpoint(self, checkpoint: CheckpointRecord) -> None:
        """A checkpoint is complete on every rank: list it (and prune the run's older ones)."""

    def forget_checkpoint(self, checkpoint: CheckpointRecord) -> None:
        """A checkpoint is about to be overwritten: unlist it first."""

    def forget_model(self, model_id: str) -> None:
        """A model was unloaded on every rank: delete what it kept only for itself (its sampler snapshots' files)."""


class StepRole(enum.Enum):
    """A kind's part in the log line of a training step (``metrics``)."""

    NONE = enum.auto()
    #: Work of the step (forward_backward): its requests and tokens add up.
    ACCUMULATE = enum.auto()
    #: Ends the step (optim_step): the line is written.
    END = enum.auto()
    #: The model is gone (unload): its step is forgotten.
    FORGET = enum.auto()


def _first(parts: list[Any]) -> Any:
    """The result is rank 0's part (every rank returns the same, or only rank 0 has one)."""
    return parts[0]


def _concatenate_datums(parts: list[Any]) -> FwdBwdResult:
    """Each rank's share of the datums, in rank order: the request's datums in their order."""
    pairs = [pair for part in parts for pair in part]
    return FwdBwdResult(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))


def _merge_sample_batch(parts: list[Any]) -> list[tuple[str, Any]]:
    """Per job of the batch: ``("ok", SampleResult)``, or the first rank's ``(category, message)``."""
    merged = []
    for per_job in zip(*parts):
        failed = next((status for status in per_job if status[0] != "ok"), None)
        merged.append(failed or ("ok", merge_samples([status[1] for status in per_job])))
    return merged


def _prepare_save(worker: Worker, recorder: Recorder, model_id: str, payload: Any) -> None:
    worker.prepare_save(model_id, payload)
    recorder.forget_checkpoint(payload.checkpoint)


def _record_checkpoint(recorder: Recorder, payload: Any) -> None:
    if payload.checkpoint is not None:  # an unnamed sampler snapshot is not a checkpoint
        recorder.record_checkpoint(payload.checkpoint)


@dataclass(frozen=True)
class Command:
    """What one job kind does; see the module's docstring."""

    #: Every rank: this rank's part of the result, ``(worker, model_id, payload)``.
    run: Callable[[Worker, str, Any], Any]
    #: Rank 0: one result from every rank's part, in rank order.
    merge: Callable[[list[Any]], Any] = _first
    #: Rank 0, before the command is broadcast: a ``UserError`` fails the job there and then.
    prepare: Callable[[Worker, Recorder, str, Any], None] | None = None
    #: Rank 0, once every rank succeeded and before the future resolves.
    record: Callable[[Recorder, Any], None] | None = None
    #: Consecutive jobs of this kind run as one command of ``batch_kind``, up to ``batch_limit`` of them; its
    #: merge gives each job its ``(status, value)``.
    batch_kind: JobKind | None = None
    batch_limit: int = 1
    #: The ``tinker_tokens`` label of the tokens its result processed (None: not counted).
    tokens: str | None = None
    step: StepRole = StepRole.NONE


COMMANDS: dict[JobKind, Command] = {
    JobKind.CREATE: Command(lambda worker, model_id, record: worker.create(model_id, record),
                            record=lambda recorder, record: recorder.record_run(record)),
    JobKind.UNLOAD: Command(lambda worker, model_id, _: worker.unload(model_id), step=StepRole.FORGET,
                            record=lambda recorder, model_id: recorder.forget_model(model_id)),
    JobKind.FORWARD_BACKWARD: Command(lambda worker, model_id, request: worker.forward_backward(model_id, request),
                                      _concatenate_datums, tokens="train", step=StepRole.ACCUMULATE),
    JobKind.FORWARD: Command(lambda worker, model_id, request: worker.forward_backward(model_id, request),
                             _concatenate_datums, tokens="forward"),
    JobKind.OPTIM_STEP: Command(lambda worker, model_id, adam: worker.optim_step(model_id, adam), step=StepRole.END),
    JobKind.SAVE_WEIGHTS: Command(lambda worker, model_id, save: worker.save_weights(model_id, save),
                                  prepare=_prepare_save, record=_record_checkpoint),
    JobKind.LOAD_WEIGHTS: Command(lambda worker, model_id, load: worker.load_weights(model_id, load)),
    JobKind.SAVE_SAMPLER: Command(lambda worker, model_id, save: worker.save_sampler(model_id, save),
                                  record=_record_checkpoint),
    JobKind.SAVE_EXTERNAL: Command(lambda worker, model_id, save: worker.save_external(model_id, save),
                                   record=_record_checkpoint),
    JobKind.SAMPLE: Command(lambda worker, _, job: worker.sample(job), merge_samples, tokens="sample",
                            batch_kind=JobKind.SAMPLE_MANY, batch_limit=32),
    JobKind.SAMPLE_MANY: Command(lambda worker, _, jobs: worker.sample_many(jobs), _merge_sample_batch),
}

#: The ``tinker_tokens`` labels, in the table's order.
TOKEN_LABELS = tuple(dict.fromkeys(command.tokens for command in COMMANDS.values() if command.tokens))


def run_command(worker: Worker, kind: JobKind, model_id: str, payload: Any) -> Any:
    """This rank's part of one command, under the worker's lock (see ``Worker.lock``)."""
    with worker.lock:
        return COMMANDS[JobKind(kind)].run(worker, model_id, payload)
