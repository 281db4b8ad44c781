"""Fixtures for the Tinker-protocol server tests (of the installed deepspeed_tinker).

Local Hugging Face models built here with ``save_pretrained``, for the servers to serve (``--base-model``): a tiny
GPT-2 under its path, and tiny Qwen3 and Llama models with chat tokenizers (``deepspeed_tinker.tiny_models``) under
Hugging Face names tinker-cookbook knows (``--base-model NAME=PATH``, ``CHAT_MODELS``). The servers the whole session
shares, one per ZeRO stage, are in session_servers/conftest.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import pytest

# pytest puts this folder on the path (it has no __init__.py): tinker_sdk_helpers lives here.
from tinker_sdk_helpers import CHAT_MODELS, build_tiny_hf_model, require


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
