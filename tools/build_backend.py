"""PEP 517 backend: ``pip install .`` builds DeepSpeed 0.19.3 with its whole patch series applied;
``DS_SERIES_BASE=0.19.8 pip install .`` builds 0.19.8 with its follow-up series.

The project itself holds only patches, so the wheel is built from the pinned upstream sdist (fetched
and verified by ``stack.py``) after applying every PR in ``patches/deepspeed-<version>/series``. The wheel
is DeepSpeed's own, built by its own ``setup.py`` with JIT-compiled ops, and versioned
``<version>+<series tag>.<n>`` (``0.19.3+unmanagedga.<n>``). DeepSpeed's ``setup.py`` needs no torch to
build, so pip's isolated build never pulls one. Upstream's tests/ and docs/, which some series lay into
the tree for their PRs' tests, are not needed here: without them those hunks are left out.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stack  # noqa: E402

from setuptools import build_meta as _setuptools  # noqa: E402


def _patched_tree(workdir: str) -> Path:
    return stack.materialize(Path(workdir) / "deepspeed", upto=None, require_extras=False)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    """Build DeepSpeed's wheel from the patched upstream tree."""
    with tempfile.TemporaryDirectory(prefix="deepspeed-series-") as workdir:
        tree = _patched_tree(workdir)
        env = stack.build_env(len(stack.read_series()))
        saved_env, saved_cwd, saved_path = dict(os.environ), os.getcwd(), list(sys.path)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(tree)
        sys.path.insert(0, str(tree))
        try:
            # DeepSpeed ships a setup.py without a pyproject.toml: pip would use the legacy backend too.
            return _setuptools.__legacy__.build_wheel(str(Path(wheel_directory).resolve()), config_settings)
        finally:
            os.chdir(saved_cwd)
            sys.path[:] = saved_path
            os.environ.clear()
            os.environ.update(saved_env)


def get_requires_for_build_wheel(config_settings=None):
    return ["wheel"]
