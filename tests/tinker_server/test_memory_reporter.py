"""The memory reporter (``/metrics``' per-rank memory) never reads the engines' tensors while a command changes
them: a command's C++ (autograd, the optimizer, gloo) frees and replaces storages without the GIL, and a read from
the reporter's thread at that moment killed a rank (SIGSEGV in ``StorageImpl``'s release; in the full suite's
ZeRO-0 server). ``Worker.lock`` keeps the two apart. Two real ranks train 600 steps with the reporter reading as
often as it can; without the lock they die within a few seconds (SIGSEGV or SIGABRT), every time it was tried."""

from __future__ import annotations

from pathlib import Path

import pytest
from tinker_sdk_helpers import require, run_rank_script

pytestmark = pytest.mark.pr("zero-0-1")

SCRIPT = Path(__file__).with_name("memory_reporter_ranks.py")
WORLD = 2
STEPS = 600


def test_memory_reports_never_run_beside_a_command(tmp_path: Path) -> None:
    require("peft")
    for seen in run_rank_script(SCRIPT, [str(STEPS)], tmp_path, WORLD):
        assert seen["steps"] == STEPS
        # The reporter ran all along and counted the engine's tensors between the last steps, not only at the start.
        report = seen["report"]
        assert report["engines"] > 0
        assert seen["now"] - report["time"] < 5.0 and seen["now"] - report["counted_at"] < 5.0
