"""Fixtures for the Tinker-protocol server tests: the repo on sys.path, servers stopped by PID.

One 2-rank server per ZeRO stage serves the whole session (starting one costs ~20 s on 2 cores);
every test creates its own models on it. Each also serves a tiny local Hugging Face model
(``--base-model``), built here with ``save_pretrained``, under its path and under a Hugging Face name
(``--base-model NAME=PATH``, ``NAMED_MODEL``).
"""

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

from tinker_sdk_helpers import (NAMED_MODEL, build_tiny_hf_model, require, start_server, stop_server,  # noqa: E402
                                unmanaged_stage_supported)


@pytest.fixture(scope="session")
def local_hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 directory (weights, config, byte-level tokenizer) saved with ``save_pretrained``."""
    require("transformers")
    return build_tiny_hf_model(tmp_path_factory.mktemp("hf-model") / "tiny-gpt2")


@pytest.fixture(scope="session", params=[0, 1, 2, 3], ids=lambda s: f"zero{s}")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, local_hf_model: Path) -> Iterator:
    """One 2-rank server per supported ZeRO stage, shared by every test of the session."""
    require("tinker")
    if not unmanaged_stage_supported(request.param):
        pytest.skip(f"this DeepSpeed does not support unmanaged mode with ZeRO stage {request.param}")
    tmp_dir = tmp_path_factory.mktemp(f"tinker-zero{request.param}")
    server = start_server(tmp_dir, request.param, base_models=(local_hf_model, f"{NAMED_MODEL}={local_hf_model}"))
    server.checkpoint_dir = tmp_dir / "ckpt"
    server.zero_stage = request.param
    server.local_model = str(local_hf_model)
    try:
        yield server
    finally:
        stop_server(server)
