"""Parametrisation helpers: every engine configuration is a test case tagged with the PR that supports it."""

from __future__ import annotations

import pytest

from .paths import PATHS


def pr_of(path_name: str) -> str:
    """The PR that supports a path: zero-0-1 brings stages 0/1, zero-2 stage 2, zero-3 stage 3, zero-offload
    offload."""
    if "offload" in path_name:
        return "zero-offload"
    return {0: "zero-0-1", 1: "zero-0-1", 2: "zero-2", 3: "zero-3"}[PATHS[path_name].stage]


def cases(*path_names: str) -> list:
    """pytest params for ``path_names``, each marked with its PR so that ``--upto K`` selects it."""
    return [pytest.param(name, id=name, marks=pytest.mark.pr(pr_of(name))) for name in path_names]
