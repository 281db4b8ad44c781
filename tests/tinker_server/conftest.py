"""Fixtures for the Tinker-protocol server tests: the repo on sys.path, servers stopped by PID."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for path in (ROOT, HERE):  # the server package lives in examples/; tinker_sdk_helpers lives here
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from tinker_sdk_helpers import require, start_server, stop_server, unmanaged_stage_supported  # noqa: E402


@pytest.fixture(scope="module", params=[0, 1, 2, 3], ids=lambda s: f"zero{s}")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One 2-rank server per supported ZeRO stage, shared by a module's tests."""
    require("tinker")
    if not unmanaged_stage_supported(request.param):
        pytest.skip(f"this DeepSpeed does not support unmanaged mode with ZeRO stage {request.param}")
    tmp_dir = tmp_path_factory.mktemp(f"tinker-zero{request.param}")
    server = start_server(tmp_dir, request.param)
    server.checkpoint_dir = tmp_dir / "ckpt"
    server.zero_stage = request.param
    try:
        yield server
    finally:
        stop_server(server)
