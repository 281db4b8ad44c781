"""PEP 517 backend: ``pip install .`` builds DeepSpeed 0.19.8 with its whole follow-up series applied;
``DS_SERIES_BASE=0.19.3 pip install .`` builds 0.19.3 with its independent series (the RFC's stacked PRs).

The project itself holds only patches, so the wheel is built from the pinned upstream sdist (fetched
and verified by ``stack.py``) after applying every PR in ``patches/deepspeed-<version>/series``. The wheel
is DeepSpeed's own, built by its own ``setup.py`` with JIT-compiled ops, and versioned
``<version>+<series tag>.<n>`` (``0.19.8+gafollowups.<n>``, ``0.19.3+unmanagedga.<n>``). DeepSpeed's ``setup.py``
needs no torch to build, so pip's isolated build never pulls one. Upstream's tests/ and docs/, which some series lay
into the tree for their PRs' tests, are not needed here: without them those hunks are left out.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from setuptools import build_meta as _setuptools

from ds_series import stack


def _patched_tree(base: stack.Base, workdir: str) -> Path:
    return stack.materialize(base, Path(workdir) / "deepspeed", upto=None, require_extras=False)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    """Build DeepSpeed's wheel from the patched upstream tree."""
    with tempfile.TemporaryDirectory(prefix="deepspeed-series-") as workdir:
        base = stack.default_base()  # $DS_SERIES_BASE or the default
        tree = _patched_tree(base, workdir)
        env = stack.build_env(base, len(base.series()))
        saved_env, saved_cwd = dict(os.environ), os.getcwd()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(tree)
        try:
            # DeepSpeed ships a setup.py without a pyproject.toml: pip would use the legacy backend too (which also
            # makes the tree importable while its setup.py runs).
            return _setuptools.__legacy__.build_wheel(str(Path(wheel_directory).resolve()), config_settings)
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)


def get_requires_for_build_wheel(config_settings=None):
    return ["wheel"]
