"""Checkpoint weights on disk, as safetensors in the layouts other tools load.

A LoRA model's weights are a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``,
PEFT's own key names), which ``peft.PeftModel.from_pretrained(base, directory)`` and
tinker-cookbook's ``weights.build_lora_adapter`` / ``build_hf_model`` read. A fully fine-tuned
model's weights are a Hugging Face model directory (``config.json`` + ``model.safetensors``), which
``AutoModelForCausalLM.from_pretrained(directory)`` loads. No pickles: safetensors holds only tensors.

In memory the server keys weights by the training module's parameter names (PEFT's carry the
adapter name, ``...lora_A.default.weight``); on disk they carry PEFT's file names (``...lora_A.weight``).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_WEIGHTS = "model.safetensors"
MODEL_CONFIG = "config.json"
#: The adapter name ``peft.get_peft_model`` gives the one adapter the server trains.
ADAPTER_NAME = "default"
#: Tokenizer files an export carries along (whichever the tokenizer directory has).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")

_PEFT_FILE_KEY = re.compile(r"^(.*\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector))\.(weight|bias)$")


def module_key(file_key: str, adapter: str = ADAPTER_NAME) -> str:
    """A PEFT file key (``...q_proj.lora_A.weight``) as the training module names it (``...lora_A.default.weight``)."""
    match = _PEFT_FILE_KEY.match(file_key)
    if match is None:
        raise ValueError(f"not a LoRA adapter tensor: {file_key!r}")
    return f"{match.group(1)}.{adapter}.{match.group(2)}"


def is_adapter(directory: Path) -> bool:
    return (directory / ADAPTER_WEIGHTS).is_file()


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def write_weights(directory: Path, module: torch.nn.Module, weights: dict[str, torch.Tensor],
                  served_name: str) -> None:
    """Write ``weights`` (module parameter names; the trainable ones for LoRA) of ``module`` into ``directory``:
    a PEFT adapter for a ``PeftModel``, else a Hugging Face model directory. ``served_name`` becomes the
    adapter's ``base_model_name_or_path`` (the name the server serves the base model under)."""
    import peft

    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(module, peft.PeftModel):
        tensors = peft.get_peft_model_state_dict(module, state_dict=weights, adapter_name=ADAPTER_NAME,
                                                 save_embedding_layers=False)
        config = copy.deepcopy(module.peft_config[ADAPTER_NAME])
        config.base_model_name_or_path = served_name
        config.inference_mode = True
        config.task_type = "CAUSAL_LM"  # PeftModel.from_pretrained then gives a PeftModelForCausalLM (generate())
        _save_safetensors(tensors, directory / ADAPTER_WEIGHTS)
        config.save_pretrained(str(directory))
    else:
        _save_safetensors(weights, directory / MODEL_WEIGHTS)
        module.config.save_pretrained(str(directory))


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The weights ``write_weights`` wrote, under the training module's parameter names."""
    from safetensors.torch import load_file

    if is_adapter(directory):
        return {module_key(k): v for k, v in load_file(str(directory / ADAPTER_WEIGHTS)).items()}
    return load_file(str(directory / MODEL_WEIGHTS))


def adapter_config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / ADAPTER_CONFIG).read_text())


def copy_tokenizer(source: Path | None, directory: Path) -> None:
    """Put the tokenizer beside exported full weights, so the directory is a complete model."""
    if source is None or not source.is_dir():
        return
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)


def parse_age_recipients(values: list[str]) -> list[Any]:
    """age recipients (``age1...`` keys or SSH public keys); ValueError names a bad one."""
    import pyrage

    recipients = []
    for value in values:
        try:
            kind = pyrage.ssh if value.startswith(("ssh-", "ecdsa-")) else pyrage.x25519
            recipients.append(kind.Recipient.from_str(value))
        except Exception as e:  # pyrage raises its own error types for malformed keys
            raise ValueError(f"not an age recipient: {value[:40]!r} ({e})") from None
    return recipients


def encrypt_files(directory: Path, recipients: list[str]) -> None:
    """Replace every file in ``directory`` by its age encryption ``<name>.age`` (Tinker's encrypted exports)."""
    import pyrage

    parsed = parse_age_recipients(recipients)
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        pyrage.encrypt_file(str(path), str(path) + ".age", parsed)
        path.unlink()


def directory_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def fsync_tree(directory: Path) -> None:
    """Flush ``directory``'s files and directories, its own included, to the disk: a checkpoint is acknowledged only
    once a crash can no longer lose it. Directories are synced after their entries."""
    for path in sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if not path.is_symlink():
            fsync_path(path)
    fsync_path(directory)


def fsync_path(path: Path) -> None:
    """Flush one file, or one directory's entries (a rename into it), to the disk; a path gone meanwhile (another
    rank replaced it) is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
