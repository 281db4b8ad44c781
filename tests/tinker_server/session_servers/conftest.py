"""The session's Tinker servers: one 2-rank server per ZeRO stage, stopped by PID, shared by every test here.

Starting one costs 10-20 s on 2 cores, so every test creates its own models on it. Each serves the local Hugging Face
models of the folder above (``local_hf_model``, ``chat_models``). Under pytest-xdist this folder runs on one worker
(``WHOLE_ON_ONE_WORKER`` in tests/conftest.py), where pytest orders its tests by stage across the files: each
server starts once per run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

# pytest puts the folder above on the path (its conftest.py): tinker_sdk_helpers lives there.
from tinker_sdk_helpers import NAMED_MODEL, require, start_server, stop_server, unmanaged_stage_supported


@pytest.fixture(scope="session", params=[0, 1, 2, 3], ids=lambda s: f"zero{s}")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, local_hf_model: Path,
           chat_models: dict[str, Path]) -> Iterator:
    """One 2-rank server per supported ZeRO stage, shared by every test of the session."""
    require("tinker")
    if not unmanaged_stage_supported(request.param):
        pytest.skip(f"this DeepSpeed does not support unmanaged mode with ZeRO stage {request.param}")
    tmp_dir = tmp_path_factory.mktemp(f"tinker-zero{request.param}")
    named = tuple(f"{name}={path}" for name, path in chat_models.items())
    server = start_server(tmp_dir, request.param, base_models=(local_hf_model, chat_models[NAMED_MODEL], *named))
    server.checkpoint_dir = tmp_dir / "ckpt"
    server.zero_stage = request.param
    server.local_model = str(local_hf_model)
    server.chat_models = chat_models
    try:
        yield server
    finally:
        stop_server(server)
