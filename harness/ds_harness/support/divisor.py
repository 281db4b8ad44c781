"""The series' per-step gradient divisor, through whichever API the installed build has.

The 0.19.3 series has ``step(gradient_divide_factor=f)``: one global factor, the same on every rank. The 0.19.8 series
has ``step(gradient_divide_count=n)`` with ``"require_gradient_divide_count": true``: each rank passes its own count
and DeepSpeed divides by their sum, so the ranks cannot disagree on the divisor.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def divides_by_count() -> bool:
    """Whether the installed build takes a per-rank count (0.19.8 series) rather than a global factor."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    return "gradient_divide_count" in inspect.signature(DeepSpeedEngine.step).parameters


def divisor_config() -> dict[str, Any]:
    """The ds_config keys an engine needs before its step() takes a divisor."""
    return {"require_gradient_divide_count": True} if divides_by_count() else {}


def divisor_step_kwargs(global_factor: Any, local_count: Any) -> dict[str, Any]:
    """step() kwargs that divide the summed gradient by ``global_factor``, which is the sum over the data-parallel
    ranks of each rank's ``local_count``."""
    if divides_by_count():
        return {"gradient_divide_count": local_count}
    return {"gradient_divide_factor": global_factor}
