"""Fixtures for the Tinker-protocol server tests (of the installed deepspeed_tinker): servers stopped by PID.

One 2-rank server per ZeRO stage serves the whole session (starting one costs ~20 s on 2 cores);
every test creates its own models on it. Each also serves local Hugging Face models built here with
``save_pretrained`` (``--base-model``): a tiny GPT-2 under its path, and tiny Qwen3 and Llama models with chat
tokenizers (``deepspeed_tinker.tiny_models``) under Hugging Face names tinker-cookbook knows
(``--base-model NAME=PATH``, ``CHAT_MODELS``), the Qwen3 also under its path.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import pytest

# pytest puts this folder on the path (it has no __init__.py): tinker_sdk_helpers lives here.
from tinker_sdk_helpers import (CHAT_MODELS, NAMED_MODEL, build_tiny_hf_model, require, start_server, stop_server,
                                unmanaged_stage_supported)


@pytest.fixture(scope="session")
def local_hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 directory (weights, config, byte-level tokenizer) saved with ``save_pretrained``."""
    require("transformers")
    return build_tiny_hf_model(tmp_path_factory.mktemp("hf-model") / "tiny-gpt2")


@pytest.fixture(scope="session")
def chat_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Hugging Face name -> a tiny randomly initialised model of that architecture with a tokenizer that has the
    chat template's special tokens (``CHAT_MODELS``), so tinker-cookbook's renderers for the name work."""
    require("transformers")
    from deepspeed_tinker.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("chat-models")
    return {name: build_tiny_model(root / family, family) for name, family in CHAT_MODELS.items()}


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


@pytest.fixture
def root_logging() -> Iterator[None]:
    """tinker-cookbook replaces the root logger's handlers when it starts: give the next tests theirs back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)
