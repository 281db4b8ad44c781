"""The models this server trains, and the one loss it computes.

Models are built from local configs only (no hub download), so the server and a test's plain
PyTorch replay construct bit-identical initial weights from the same name and seed. Tokens are
bytes: token id == byte value, so any client can encode text without a tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def build_model(base_model: str, lora: LoraSpec | None) -> torch.nn.Module:
    """Construct the fp32 model: base weights from ``BASE_SEED``, adapters from ``lora.seed``.

    With ``lora`` set only the adapter weights require grad (PEFT freezes the rest).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = BASE_MODELS[base_model]
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


def token_logprobs(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``logprobs[b, t] = log p(targets[b, t] | tokens[b, :t+1])`` for a right-padded batch.

    Right padding needs no attention mask: a causal model never lets a real position attend
    to a later (padded) one.
    """
    logits = model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def cross_entropy_sum(logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Tinker's ``cross_entropy``: a weighted SUM over tokens, never a mean."""
    return -(logprobs * weights).sum()
