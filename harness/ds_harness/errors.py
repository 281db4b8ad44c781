"""Exceptions raised in the pytest process, so tests can tell failure kinds apart."""

from __future__ import annotations

from typing import Any


class RankError(Exception):
    """One or more ranks failed, died, or disagreed about skipping.

    ``outcomes`` holds one dict per rank (see ``protocol``), so a test of the
    harness can inspect what each rank reported.
    """

    def __init__(self, message: str, outcomes: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.outcomes = outcomes

    @property
    def failed_ranks(self) -> list[int]:
        return [o["rank"] for o in self.outcomes if o["status"] not in ("ok", "skip")]


class RankTimeout(RankError):
    """The per-test timeout expired before every rank reported back."""


class PoolStartError(RuntimeError):
    """The rank processes could not be started or could not rendezvous."""
