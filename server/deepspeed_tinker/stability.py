"""``record_stability_info`` and provenance: what ``stable_reinforce`` trains on.

Tinker's StableReinforce page says how the loss is used, not what it computes: sample with
``record_stability_info=True``, and name in each training datum, with provenance spans, the sampled sequence
behind every position (``sequence_id``); recorded sequences belong to the sampling session's session and can be
trained on for a day after sampling, each use restarting that day. This module keeps those records and resolves
a datum's spans against them: the tokens a span claims must be the recorded ones, and the positions whose targets
were sampled get the sampler's own logprobs from the record (not the client's copy). The objective itself is this
server's choice (``losses.stable_reinforce``), since Tinker does not publish its.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from .errors import UserError
from .wire import Datum, Span

#: How long a recorded sequence can be trained on after sampling or its last use (Tinker: one day).
RECORD_TTL_S = 24 * 3600
#: Records kept at most (the oldest go first), so a long run cannot grow the table without bound.
MAX_RECORDS = 200_000


@dataclass
class _Record:
    session_id: str
    prompt: tuple[int, ...]
    #: The sample's future and the sequence's index in its result.
    request_id: str
    index: int
    last_used: float
    #: The sequence's tokens and the sampler's logprobs, once sampling finished (kept here, not the whole result:
    #: the future store frees that once the client has retrieved it).
    sampled: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class Recorded:
    """One recorded sampled sequence: its prompt, tokens and the sampler's logprob of each sampled token."""

    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray


class StabilityRecords:
    """``sequence_id`` -> the sampled sequence, for the sequences of ``record_stability_info`` requests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._records: OrderedDict[str, _Record] = OrderedDict()
        #: request_id -> its records, until the sample finishes (``finished``).
        self._awaiting: dict[str, list[_Record]] = {}
        self._lock = threading.Lock()

    def record(self, session_id: str, sequence_ids: list[str], request_id: str, prompt: tuple[int, ...]) -> None:
        """Record a sample's sequences; ``finished`` gives them its result (the caller calls it too when the sample
        finished before it was recorded)."""
        now = self._clock()
        with self._lock:
            records = [_Record(session_id, prompt, request_id, index, now) for index in range(len(sequence_ids))]
            self._records.update(zip(sequence_ids, records, strict=True))
            self._awaiting.setdefault(request_id, []).extend(records)
            while len(self._records) > MAX_RECORDS:
                self._records.popitem(last=False)

    def finished(self, request_id: str, result: Any) -> None:
        """A sample's future finished with ``result`` (None or anything else than a ``SampleResult``: it failed):
        its records keep it."""
        sequences = getattr(result, "sequences", None)
        with self._lock:
            for record in self._awaiting.pop(request_id, ()):
                if sequences is not None:
                    sequence = sequences[record.index]
                    record.sampled = (np.asarray(sequence.tokens, np.int64), np.asarray(sequence.logprobs, np.float32))

    def get(self, sequence_id: str, session_id: str) -> Recorded:
        """The recorded sequence, for a training request of ``session_id``; using it restarts its day."""
        now = self._clock()
        with self._lock:
            record = self._records.get(sequence_id)
            if record is not None and now - record.last_used > RECORD_TTL_S:
                del self._records[sequence_id]
                record = None
            if record is None or record.session_id != session_id:
                raise UserError(f"no recorded sequence {sequence_id!r} in this session (sample with "
                                "record_stability_info=True in the same session; records expire a day after "
                                "their last use)")
            record.last_used = now
            sampled = record.sampled
        if sampled is None:
            raise UserError(f"sequence {sequence_id!r} is not sampled yet, or its sample failed")
        return Recorded(np.asarray(record.prompt, np.int64), *sampled)


def _claimed(recorded: Recorded, span: Span, where: str) -> np.ndarray:
    """The recorded tokens a span claims, checked to exist."""
    source = recorded.tokens if span.sampled else recorded.prompt
    if span.offset + span.length > len(source):
        kind = "sampled tokens" if span.sampled else "prompt"
        raise UserError(f"{where}: span [{span.offset}, {span.offset + span.length}) of {span.sequence_id!r} lies "
                        f"beyond its {len(source)} {kind}")
    return source[span.offset:span.offset + span.length]


def resolve_provenance(datum: Datum, index: int, records: StabilityRecords, session_id: str) -> Datum:
    """``datum`` with the sampler's recorded logprobs as ``sampling_logprobs`` and ``weights`` 1 exactly on the
    targets a sampled span covers (0 on prompt positions, which were not sampled); every span checked against
    the record it names."""
    if datum.target_spans is None or datum.input_spans is None:
        raise UserError(f"data[{index}]: stable_reinforce needs provenance on every datum (Datum.with_provenance: "
                        "the sequence_id of the sampled sequence behind each position)")
    for spans, tokens, name in ((datum.input_spans, datum.tokens, "model_input"),
                                (datum.target_spans, datum.targets, "target_tokens")):
        start = 0
        for span in spans:
            where = f"data[{index}].{name}[{start}:{start + span.length}]"
            claimed = _claimed(records.get(span.sequence_id, session_id), span, where)
            if not np.array_equal(claimed, tokens[start:start + span.length]):
                raise UserError(f"{where}: the tokens differ from those {span.sequence_id!r} recorded")
            start += span.length
    sampling = np.zeros(len(datum.targets), np.float32)
    sampled = np.zeros(len(datum.targets), np.float32)
    start = 0
    for span in datum.target_spans:
        if span.sampled:
            recorded = records.get(span.sequence_id, session_id)
            sampling[start:start + span.length] = recorded.logprobs[span.offset:span.offset + span.length]
            sampled[start:start + span.length] = 1.0
        start += span.length
    if not sampled.any():
        raise UserError(f"data[{index}]: no target is a sampled token, so stable_reinforce has nothing to train")
    return replace(datum, sampling_logprobs=sampling, weights=sampled)
