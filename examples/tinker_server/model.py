"""The models this server trains: built-in byte-level Llamas and local Hugging Face models.

Nothing is downloaded. The built-in models are built from local configs, so the server and a
test's plain PyTorch replay construct bit-identical initial weights from the same name and seed;
their tokens are bytes (token id == byte value). ``serve --base-model PATH`` adds a causal LM saved
with ``save_pretrained`` (any architecture ``AutoModelForCausalLM`` loads), named by its absolute
path, with its tokenizer from the same directory; ``--base-model NAME=PATH`` serves it as NAME.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

#: Seed for the base weights: every rank (and every replay) must start from the same model.
BASE_SEED = 1234


@dataclass(frozen=True)
class BaseModelSpec:
    """A small Llama-style causal LM, described by the numbers that define it."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_context_length: int
    #: A local model directory (weights, config, tokenizer); None for the built-in byte models.
    path: str | None = None
    #: What generation stops on when the client gives no stop condition (the model's EOS).
    eos_token_ids: tuple[int, ...] = ()
    #: The ``transformers`` architecture family, reported by ``get_info``.
    model_type: str = "llama"


BASE_MODELS: dict[str, BaseModelSpec] = {
    spec.name: spec
    for spec in (
        BaseModelSpec("tiny-llama-byte", 256, 64, 128, 2, 4, 2, 256),
        BaseModelSpec("small-llama-byte", 256, 128, 256, 4, 4, 2, 512),
    )
}


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA adapters to add; mirrors the SDK's ``LoraConfig``."""

    rank: int
    seed: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def target_modules(self) -> list[str]:
        """Llama module names the adapters wrap."""
        names: list[str] = []
        if self.train_attn:
            names += ["q_proj", "k_proj", "v_proj", "o_proj"]
        if self.train_mlp:
            names += ["gate_proj", "up_proj", "down_proj"]
        if self.train_unembed:
            names.append("lm_head")
        return names


def parse_base_model(value: str) -> tuple[str | None, str]:
    """A ``--base-model`` value: ``PATH`` (served under its absolute path) or ``NAME=PATH`` (served as NAME, e.g.
    the Hugging Face name ``Qwen/Qwen3-8B`` that tinker-cookbook looks renderers and learning rates up by)."""
    if "=" in value and not Path(value).expanduser().is_dir():
        name, path = value.split("=", 1)
        if not name.strip() or not path:
            raise ValueError(f"--base-model {value!r}: expected PATH or NAME=PATH")
        return name.strip(), path
    return None, value


def register_local_model(value: str | os.PathLike[str]) -> BaseModelSpec:
    """Make a local Hugging Face causal LM servable (every rank calls this): ``PATH`` under its absolute path,
    ``NAME=PATH`` under NAME."""
    from transformers import AutoConfig

    name, path = parse_base_model(str(value))
    directory = Path(path).expanduser().resolve()
    if not (directory / "config.json").is_file():
        raise ValueError(f"--base-model {value}: no config.json in {directory} (save the model with save_pretrained)")
    name = name or str(directory)
    if name in BASE_MODELS and BASE_MODELS[name].path != str(directory):
        raise ValueError(f"--base-model {value}: the name {name!r} is already served from "
                         f"{BASE_MODELS[name].path or 'a built-in config'}")
    config = AutoConfig.from_pretrained(str(directory))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = next((getattr(text, a) for a in ("max_position_embeddings", "n_positions", "max_sequence_length")
                    if getattr(text, a, None)), 2048)
    eos = getattr(text, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos), ))
    spec = BaseModelSpec(name, int(text.vocab_size), int(getattr(text, "hidden_size", 0) or 0), 0,
                         int(getattr(text, "num_hidden_layers", 0) or 0), 0, 0, int(context), path=str(directory),
                         eos_token_ids=eos_ids, model_type=str(config.model_type))
    BASE_MODELS[spec.name] = spec
    return spec


def _lora_targets(model: torch.nn.Module, lora: LoraSpec) -> list[str]:
    """The Llama-style module names the architecture has; for other architectures PEFT's default
    targets for its ``model_type``. The unembedding only when it is not tied to the embedding."""
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    wanted = [n for n in lora.target_modules() if n in present and n != "lm_head"]
    if not wanted and (lora.train_attn or lora.train_mlp):
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        wanted = list(DEFAULTS.get(model.config.model_type, []))
    tied = getattr(model.config, "tie_word_embeddings", False)
    if lora.train_unembed and "lm_head" in present and not tied:
        wanted.append("lm_head")
    if not wanted:
        raise ValueError(f"no LoRA target modules known for {model.config.model_type} with {lora}")
    return wanted


def build_model(base_model: str, lora: LoraSpec | None) -> torch.nn.Module:
    """Construct the fp32 model: base weights from ``BASE_SEED`` (or the local directory), adapters
    from ``lora.seed``.

    With ``lora`` set only the adapter weights require grad (PEFT freezes the rest).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = BASE_MODELS[base_model]
    if spec.path is not None:
        return _build_local(spec, lora)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_context_length,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BASE_SEED)
        model = LlamaForCausalLM(config)
        if lora is None:
            return model
        import peft

        torch.manual_seed(lora.seed)
        adapters = peft.LoraConfig(r=lora.rank, lora_alpha=lora.rank, lora_dropout=0.0,
                                   target_modules=lora.target_modules())
        return peft.get_peft_model(model, adapters)


def _build_local(spec: BaseModelSpec, lora: LoraSpec | None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per model built is noise in a server log
    model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.float32, attn_implementation="eager")
    if lora is None:
        return model
    import peft

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lora.seed)
        adapters = peft.LoraConfig(r=lora.rank, lora_alpha=lora.rank, lora_dropout=0.0,
                                   target_modules=_lora_targets(model, lora))
        return peft.get_peft_model(model, adapters)


def token_logprobs(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``logprobs[b, t] = log p(targets[b, t] | tokens[b, :t+1])`` for a right-padded batch; with
    ``[B, T, K]`` targets (K per position) the result is ``[B, T, K]``.

    Right padding needs no attention mask: a causal model never lets a real position attend
    to a later (padded) one.
    """
    logits = model(input_ids=tokens).logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    if targets.dim() == 3:
        return logprobs.gather(-1, targets)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def cross_entropy_sum(logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Tinker's ``cross_entropy``: a weighted SUM over tokens, never a mean."""
    return -(logprobs * weights).sum()
