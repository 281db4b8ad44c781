"""Messages between the pytest process and the ranks.

Only builtins cross the socket (dicts, strings, bytes) so the harness package
may be imported under different names in the parent and the ranks without
breaking unpickling. Payloads from the test module travel as pickled bytes and
are unpickled only after the rank has imported that module.
"""

from __future__ import annotations

from typing import Any

# Environment variables the pool hands to each rank process.
ENV_FD = "HARNESS_CONN_FD"
ENV_BACKEND = "HARNESS_BACKEND"
ENV_PARENT_PID = "HARNESS_PARENT_PID"
ENV_INIT = "HARNESS_INIT"  # "deepspeed" (deepspeed.comm.init_distributed) or "torch"

# Rank statuses. "ok" and "skip" come from the rank; the others are assigned
# by the parent when a rank did not report.
OK, SKIP, ERROR = "ok", "skip", "error"
DIED, HUNG, KILLED = "died", "hung", "killed"


def make_task(module: str, path: str, qualname: str, payload: bytes, seed: int, cwd: str) -> dict[str, Any]:
    """One test body invocation, identical for every rank."""
    return {
        "module": module,
        "path": path,
        "qualname": qualname,
        "payload": payload,
        "seed": seed,
        "cwd": cwd,
    }


def make_outcome(rank: int,
                 status: str,
                 value: bytes | None = None,
                 summary: str = "",
                 traceback: str = "") -> dict[str, Any]:
    """What one rank did with a task; ``output``/``stack`` are filled in by the parent."""
    return {
        "rank": rank,
        "status": status,
        "value": value,
        "summary": summary,
        "traceback": traceback,
        "output": "",
        "stack": "",
    }
