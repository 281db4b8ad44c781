"""Turn per-rank outcomes into a return value, a skip, or a failure message naming ranks.

The message is what pytest shows, so it carries each failed rank's own traceback and the
tail of its output; hung ranks show the stack they were dumped with.
"""

from __future__ import annotations

import pickle
from typing import Any, NoReturn

from . import protocol as P
from .errors import RankError, RankTimeout

OUTPUT_TAIL_LINES = 40


def conclude(outcomes: list[dict[str, Any]], timeout: float) -> list[Any]:
    """Values indexed by rank if all ranks returned; skip if all skipped; raise otherwise."""
    __tracebackhide__ = True
    statuses = {o["status"] for o in outcomes}
    if statuses == {P.OK}:
        return [pickle.loads(o["value"]) for o in outcomes]
    if statuses == {P.SKIP}:
        _skip(outcomes)
    _fail(outcomes, timeout)


def _skip(outcomes: list[dict[str, Any]]) -> NoReturn:
    import pytest

    reasons = sorted({o["summary"] for o in outcomes})
    if len(reasons) == 1:
        msg = f"all {len(outcomes)} ranks skipped: {reasons[0]}"
    else:
        msg = f"all {len(outcomes)} ranks skipped: " + "; ".join(
            f"{_ranks(o['rank'] for o in outcomes if o['summary'] == r)}: {r}" for r in reasons)
    try:
        # Report the test's location in `-rs`, not this file's (as a skip in a fixture does).
        exc = pytest.skip.Exception(msg, _use_item_location=True)
    except TypeError:  # private keyword; absent in old pytest
        exc = pytest.skip.Exception(msg)
    raise exc


def _ranks(ranks: Any) -> str:
    rs = sorted(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def headline(outcomes: list[dict[str, Any]], timeout: float) -> str:
    w = len(outcomes)
    by: dict[str, list[int]] = {}
    for o in outcomes:
        by.setdefault(o["status"], []).append(o["rank"])
    errors = by.get(P.ERROR, []) + by.get(P.DIED, [])
    if errors:
        first = next(o for o in outcomes if o["rank"] in errors)
        more = "" if len(errors) == 1 else f" (first: rank {first['rank']})"
        return f"{_ranks(errors)} of {w} failed{more}: {first['summary']}"
    if P.HUNG in by:
        return f"timed out after {timeout:g} s: {_ranks(by[P.HUNG])} of {w} did not finish (stacks below)"
    if P.SKIP in by:
        others = [o["rank"] for o in outcomes if o["status"] != P.SKIP]
        reason = next(o["summary"] for o in outcomes if o["status"] == P.SKIP)
        return (f"skips disagree: {_ranks(by[P.SKIP])} of {w} skipped ({reason!r}) "
                f"but {_ranks(others)} did not")
    return f"ranks did not complete: {by}"


def _fail(outcomes: list[dict[str, Any]], timeout: float) -> NoReturn:
    __tracebackhide__ = True
    lines = [headline(outcomes, timeout), ""]
    for o in outcomes:
        lines.append(f"  rank {o['rank']}: {o['status']}" + (f" - {o['summary']}" if o["summary"] else ""))
    for o in sorted(outcomes, key=_section_order):
        if o["status"] in (P.OK, P.SKIP) and not o["output"].strip():
            continue
        r = o["rank"]
        if o["traceback"]:
            lines += ["", f"===== rank {r} traceback =====", o["traceback"].rstrip()]
        if o["output"].strip():
            lines += ["", f"===== rank {r} output (last {OUTPUT_TAIL_LINES} lines) =====", _tail(o["output"])]
        if o["stack"].strip():
            lines += ["", f"===== rank {r} stacks when killed =====", o["stack"].rstrip()]
    message = "\n".join(lines)
    if all(o["status"] in (P.OK, P.HUNG) for o in outcomes):
        raise RankTimeout(message, outcomes)
    raise RankError(message, outcomes)


def _section_order(o: dict[str, Any]) -> tuple[int, int]:
    rank_of_status = {P.ERROR: 0, P.DIED: 1, P.SKIP: 2, P.HUNG: 3, P.KILLED: 4, P.OK: 5}
    return rank_of_status.get(o["status"], 9), o["rank"]


def _tail(text: str) -> str:
    lines = text.rstrip().splitlines()
    return "\n".join(lines[-OUTPUT_TAIL_LINES:])
