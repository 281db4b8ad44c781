"""Training runs and their checkpoints, in SQLite beside the checkpoints, so listings survive a restart.

Rank 0 alone uses it (HTTP threads and the job loop, one connection behind a lock). A checkpoint is
recorded once its files are complete and on disk, and its save is acknowledged only after that record is
committed (``server._record_and_resolve``); one whose ``ttl_seconds`` have passed is hidden at once and
deleted, files and row, by ``reap()``, which the job loop calls between jobs (so it never deletes a
directory a save is writing) and at start-up (so what expired while the server was down goes too).
With ``--keep-checkpoints K``, ``prune()`` keeps only each run's K newest training and K newest sampler
checkpoints, after each save and at start-up.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .errors import UserError

DB_FILE = "tinker_server.sqlite3"
#: The tinker path segment of each checkpoint type (``tinker://<run>/<segment>/<name>``).
SEGMENTS = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
TYPES = {segment: kind for kind, segment in SEGMENTS.items()}
#: A checkpoint's name, the last segment of its tinker path (and a directory name).
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SCHEME = "tinker://"


@dataclass(frozen=True)
class TinkerPath:
    """``tinker://<run_id>/<segment>/<name>``: one checkpoint of a training run (the run id is the model id that
    saved it). Every tinker path the server reads or writes is parsed and formatted here."""

    run_id: str
    segment: str
    name: str

    @classmethod
    def parse(cls, path: str, segments: tuple[str, ...] = ("weights", )) -> TinkerPath:
        """A path naming one of ``segments``; UserError naming the expected form otherwise."""
        parts = path[len(SCHEME):].split("/") if path.startswith(SCHEME) else []
        if len(parts) != 3 or not parts[0] or parts[1] not in segments or not CHECKPOINT_NAME.match(parts[2]):
            raise UserError(f"not a checkpoint path of this server: {path!r} "
                            f"(expected tinker://<model_id>/{'|'.join(segments)}/<name>)")
        return cls(*parts)

    @classmethod
    def new(cls, run_id: str, segment: str, name: str) -> TinkerPath:
        """The path a save will write: its name checked (UserError naming the rule)."""
        if not CHECKPOINT_NAME.match(name):
            raise UserError(f"checkpoint name {name!r} must match {CHECKPOINT_NAME.pattern}")
        return cls(run_id, segment, name)

    @property
    def checkpoint_id(self) -> str:
        """The store's key within the run: ``<segment>/<name>``."""
        return f"{self.segment}/{self.name}"

    def directory(self, root: Path) -> Path:
        return checkpoint_dir(root, self.run_id, self.name, self.segment)

    def __str__(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.checkpoint_id}"


def checkpoint_dir(root: Path, model_id: str, name: str, kind: str = "weights") -> Path:
    """Where a checkpoint's files live: ``<root>/<run>/<segment>/<name>``."""
    return root / model_id.replace("/", "_") / kind / name


def parse_tinker_path(path: str, kinds: tuple[str, ...] = ("weights", )) -> tuple[str, str]:
    """``tinker://<model_id>/weights/<name>`` -> (model_id, name); ``kinds`` also allows ``sampler_weights``."""
    parsed = TinkerPath.parse(path, kinds)
    return parsed.run_id, parsed.name

_SCHEMA = """
CREATE TABLE IF NOT EXISTS training_runs (
    training_run_id TEXT PRIMARY KEY,
    base_model TEXT NOT NULL,
    lora TEXT,                      -- the LoraSpec as JSON; NULL for full fine-tuning
    created REAL NOT NULL,
    last_request_time REAL NOT NULL,
    user_metadata TEXT              -- JSON object or NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    training_run_id TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL,    -- '<segment>/<name>', as in the tinker path
    checkpoint_type TEXT NOT NULL,  -- training | sampler | external
    time REAL NOT NULL,
    size_bytes INTEGER,
    expires_at REAL,                -- NULL: never
    user_metadata TEXT,
    directory TEXT NOT NULL,
    PRIMARY KEY (training_run_id, checkpoint_id)
);
"""


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat()


def string_metadata(value: Any) -> dict[str, str] | None:
    """User metadata as the SDK's responses type it (string values)."""
    if not value:
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in dict(value).items()}


@dataclass(frozen=True)
class CheckpointRow:
    training_run_id: str
    checkpoint_id: str
    checkpoint_type: str
    time: float
    size_bytes: int | None
    expires_at: float | None
    user_metadata: dict[str, str] | None
    directory: Path

    @property
    def tinker_path(self) -> str:
        return f"{SCHEME}{self.training_run_id}/{self.checkpoint_id}"

    def to_json(self) -> dict[str, Any]:
        """The SDK's ``Checkpoint``."""
        return {"checkpoint_id": self.checkpoint_id, "checkpoint_type": self.checkpoint_type, "time": iso(self.time),
                "tinker_path": self.tinker_path, "training_run_id": self.training_run_id,
                "size_bytes": self.size_bytes, "public": False, "user_metadata": self.user_metadata,
                "expires_at": iso(self.expires_at) if self.expires_at is not None else None}


class CheckpointStore:
    """The SQLite database of one server's state directory (its ``--checkpoint-dir``)."""

    def __init__(self, root: Path, clock: Any = time.time) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(root / DB_FILE), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # Each write is its own transaction (isolation_level None), committed to disk before it returns: the job loop
        # records a checkpoint and only then acknowledges its save, so an acknowledged checkpoint survives a crash.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._clock = clock

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _rows(self, sql: str, *args: Any) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _write(self, sql: str, *args: Any) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    # ------------------------------------------------------------------- runs

    def add_run(self, run_id: str, base_model: str, lora: dict[str, Any] | None,
                user_metadata: dict[str, Any] | None = None) -> None:
        now = self._clock()
        self._write("INSERT OR REPLACE INTO training_runs VALUES (?, ?, ?, ?, ?, ?)", run_id, base_model,
                    json.dumps(lora) if lora else None, now, now, json.dumps(string_metadata(user_metadata)))

    def touch_run(self, run_id: str) -> None:
        self._write("UPDATE training_runs SET last_request_time = ? WHERE training_run_id = ?", self._clock(), run_id)

    def run_json(self, run_id: str) -> dict[str, Any] | None:
        """The SDK's ``TrainingRun``, or None for a run this server never created."""
        rows = self._rows("SELECT * FROM training_runs WHERE training_run_id = ?", run_id)
        return self._run_json(rows[0]) if rows else None

    def run_lora(self, run_id: str) -> dict[str, Any] | None:
        """A run's LoraSpec fields (None for full fine-tuning or an unknown run)."""
        rows = self._rows("SELECT lora FROM training_runs WHERE training_run_id = ?", run_id)
        return json.loads(rows[0][0]) if rows and rows[0][0] else None

    def list_runs(self, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
        """A page of runs, the most recently created first, and the total count."""
        rows = self._rows("SELECT * FROM training_runs ORDER BY created DESC, training_run_id LIMIT ? OFFSET ?",
                          limit, offset)
        total = self._rows("SELECT COUNT(*) FROM training_runs")[0][0]
        return [self._run_json(row) for row in rows], total

    def _run_json(self, row: tuple) -> dict[str, Any]:
        run_id, base_model, lora, _, last_request, metadata = row
        spec = json.loads(lora) if lora else None
        latest = {kind: next(iter(self.checkpoints(run_id, kind)), None) for kind in ("training", "sampler")}
        return {"training_run_id": run_id, "base_model": base_model, "model_owner": "local",
                "is_lora": spec is not None, "corrupted": False, "lora_rank": spec["rank"] if spec else None,
                "last_request_time": iso(last_request),
                "last_checkpoint": latest["training"].to_json() if latest["training"] else None,
                "last_sampler_checkpoint": latest["sampler"].to_json() if latest["sampler"] else None,
                "user_metadata": json.loads(metadata) if metadata else None}

    # ------------------------------------------------------------ checkpoints

    def add_checkpoint(self, run_id: str, checkpoint_id: str, directory: Path, size_bytes: int,
                       ttl_seconds: int | None = None, user_metadata: dict[str, Any] | None = None) -> CheckpointRow:
        """Record a complete checkpoint (one saved again under its name replaces the old record)."""
        now = self._clock()
        kind = TYPES[checkpoint_id.split("/", 1)[0]]
        expires = now + ttl_seconds if ttl_seconds is not None else None
        metadata = string_metadata(user_metadata)
        self._write("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?)", run_id, checkpoint_id, kind,
                    now, size_bytes, expires, json.dumps(metadata), str(directory))
        return CheckpointRow(run_id, checkpoint_id, kind, now, size_bytes, expires, metadata, directory)

    def checkpoints(self, run_id: str | None = None, kind: str | None = None, limit: int = -1,
                    offset: int = 0) -> list[CheckpointRow]:
        """Unexpired checkpoints, newest first; of one run and of one type when given."""
        where, args = ["(expires_at IS NULL OR expires_at > ?)"], [self._clock()]
        if run_id is not None:
            where.append("training_run_id = ?")
            args.append(run_id)
        if kind is not None:
            where.append("checkpoint_type = ?")
            args.append(kind)
        rows = self._rows(f"SELECT * FROM checkpoints WHERE {' AND '.join(where)} "
                          "ORDER BY time DESC, checkpoint_id LIMIT ? OFFSET ?", *args, limit, offset)
        return [self._checkpoint(row) for row in rows]

    def count_checkpoints(self) -> int:
        return self._rows("SELECT COUNT(*) FROM checkpoints WHERE expires_at IS NULL OR expires_at > ?",
                          self._clock())[0][0]

    def checkpoint(self, run_id: str, checkpoint_id: str) -> CheckpointRow | None:
        """An unexpired checkpoint, or None."""
        rows = self._rows("SELECT * FROM checkpoints WHERE training_run_id = ? AND checkpoint_id = ? "
                          "AND (expires_at IS NULL OR expires_at > ?)", run_id, checkpoint_id, self._clock())
        return self._checkpoint(rows[0]) if rows else None

    @staticmethod
    def _checkpoint(row: tuple) -> CheckpointRow:
        run_id, checkpoint_id, kind, saved, size, expires, metadata, directory = row
        return CheckpointRow(run_id, checkpoint_id, kind, saved, size, expires,
                             json.loads(metadata) if metadata else None, Path(directory))

    def set_ttl(self, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> bool:
        """Expire ``ttl_seconds`` from now (None: never); False for an unknown or expired checkpoint."""
        if self.checkpoint(run_id, checkpoint_id) is None:
            return False
        expires = self._clock() + ttl_seconds if ttl_seconds is not None else None
        self._write("UPDATE checkpoints SET expires_at = ? WHERE training_run_id = ? AND checkpoint_id = ?", expires,
                    run_id, checkpoint_id)
        return True

    def delete(self, run_id: str, checkpoint_id: str) -> bool:
        """Delete a checkpoint's files and record; False for an unknown or expired one."""
        row = self.checkpoint(run_id, checkpoint_id)
        if row is None:
            return False
        self._remove(row)
        return True

    def forget(self, run_id: str, checkpoint_id: str) -> None:
        """Drop the record only (its directory is about to be written again)."""
        self._write("DELETE FROM checkpoints WHERE training_run_id = ? AND checkpoint_id = ?", run_id, checkpoint_id)

    def reap(self) -> list[str]:
        """Delete every expired checkpoint, files and record; their tinker paths."""
        rows = [self._checkpoint(row) for row in self._rows(
            "SELECT * FROM checkpoints WHERE expires_at IS NOT NULL AND expires_at <= ?", self._clock())]
        for row in rows:
            self._remove(row)
        return [row.tinker_path for row in rows]

    def prune(self, keep: int, run_id: str | None = None) -> list[str]:
        """Keep the ``keep`` newest unexpired training and the ``keep`` newest unexpired sampler checkpoints of each
        run (of ``run_id`` when given) and delete the older ones, files and record; their tinker paths. Exports
        (``external``) are left alone: a download deletes its own once fetched."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        where = ["checkpoint_type IN ('training', 'sampler')", "(expires_at IS NULL OR expires_at > ?)"]
        args: list[Any] = [self._clock()]
        if run_id is not None:
            where.append("training_run_id = ?")
            args.append(run_id)
        rows = [self._checkpoint(row) for row in self._rows(
            f"SELECT * FROM checkpoints WHERE {' AND '.join(where)} "
            "ORDER BY training_run_id, checkpoint_type, time DESC, checkpoint_id", *args)]
        seen: dict[tuple[str, str], int] = {}
        pruned = []
        for row in rows:
            key = (row.training_run_id, row.checkpoint_type)
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > keep:
                self._remove(row)
                pruned.append(row.tinker_path)
        return pruned

    def _remove(self, row: CheckpointRow) -> None:
        shutil.rmtree(row.directory, ignore_errors=True)
        layout = row.directory.parent.name == SEGMENTS[row.checkpoint_type]  # <root>/<run>/<segment>/<name>
        for parent in (row.directory.parent, row.directory.parent.parent) if layout else ():  # once empty
            try:
                parent.rmdir()
            except OSError:  # not empty (or gone): keep it
                break
        self.forget(row.training_run_id, row.checkpoint_id)
