"""The command table is the one place that says what a job kind does: every kind has its command, and no other
server module switches on a kind (neither on its string nor on its ``JobKind`` member)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from deepspeed_tinker.commands import COMMANDS, TOKEN_LABELS, StepRole
from deepspeed_tinker.jobs import JobKind
from deepspeed_tinker.wire import FwdBwdResult

pytestmark = pytest.mark.pr("zero-0-1")
PACKAGE = Path(__file__).resolve().parents[2] / "server" / "deepspeed_tinker"
TABLE_MODULES = {"commands.py", "jobs.py"}


def test_every_kind_has_a_command_and_every_batch_kind_too() -> None:
    assert set(COMMANDS) == set(JobKind)
    for kind, command in COMMANDS.items():
        if command.batch_kind is not None:
            assert command.batch_kind in COMMANDS and command.batch_limit > 1, kind
    assert TOKEN_LABELS == ("train", "forward", "sample")
    assert [kind for kind, c in COMMANDS.items() if c.step is not StepRole.NONE] == [
        JobKind.UNLOAD, JobKind.FORWARD_BACKWARD, JobKind.OPTIM_STEP]


def _kind_comparisons(path: Path) -> list[str]:
    """``==``/``!=``/``in``/``is`` comparisons with a job kind's string or a ``JobKind`` member."""
    values = {kind.value for kind in JobKind}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        for operand in (node.left, *node.comparators):
            names_a_kind = isinstance(operand, ast.Constant) and operand.value in values
            names_a_kind |= (isinstance(operand, ast.Attribute) and isinstance(operand.value, ast.Name)
                             and operand.value.id == "JobKind")
            if names_a_kind:
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_module_outside_the_table_switches_on_a_kind() -> None:
    found = [hit for path in sorted(PACKAGE.glob("*.py")) if path.name not in TABLE_MODULES
             for hit in _kind_comparisons(path)]
    assert found == []


def test_forward_backward_parts_concatenate_in_rank_order() -> None:
    parts = [[(np.array([1.0]), np.array([10.0]))], [(np.array([2.0]), np.array([20.0])),
                                                     (np.array([3.0]), np.array([30.0]))]]
    merged = COMMANDS[JobKind.FORWARD_BACKWARD].merge(parts)
    assert isinstance(merged, FwdBwdResult)
    assert [float(x[0]) for x in merged.logprobs] == [1.0, 2.0, 3.0]
