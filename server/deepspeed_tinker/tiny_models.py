"""Tiny, randomly initialised models of real architectures (Qwen3, Llama) with chat tokenizers, built locally.

tinker-cookbook picks the renderer, learning rate and tokenizer for a model by its Hugging Face name, and its
renderers encode the chat template's special tokens (``<|im_start|>``, ``<|eot_id|>``, …) as single tokens.
Serving such a name (``--base-model Qwen/Qwen3-8B=DIR``) offline needs a directory with that architecture and a
tokenizer that has those tokens: this builds one in seconds, nothing downloaded. The tokenizer is byte-level
(ids 0-255 are the bytes, as in ``byte_tokenizer``, so any text encodes) with the family's special tokens after
them and a chat template in the family's format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .byte_tokenizer import _bytes_to_unicode


@dataclass(frozen=True)
class ChatFamily:
    """What a family's tokenizer must carry for tinker-cookbook's renderers of that family."""

    special_tokens: tuple[str, ...]
    #: Added tokens that are not "special" (decoded like text), as in the real tokenizers.
    plain_added_tokens: tuple[str, ...]
    bos_token: str | None
    eos_token: str
    pad_token: str | None
    chat_template: str


QWEN3_TEMPLATE = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                  "+ '<|im_end|>\\n' }}{%- endfor %}"
                  "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3_TEMPLATE = ("{{ bos_token }}{%- for message in messages %}{{ '<|start_header_id|>' + message['role'] "
                   "+ '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
                   "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
                   "{%- endif %}")

#: The tokens the cookbook's ``qwen3*`` renderers (Qwen3's chat format, thinking and tool calls) and its
#: ``llama3`` / ``role_colon`` renderers (Llama 3's header format, BOS, EOS) encode as single tokens.
FAMILIES: dict[str, ChatFamily] = {
    "qwen3": ChatFamily(("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                        ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
                        None, "<|im_end|>", "<|endoftext|>", QWEN3_TEMPLATE),
    "llama": ChatFamily(("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"), (),
                        "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", LLAMA3_TEMPLATE),
}


def chat_tokenizer(family: str) -> Any:
    """A ``PreTrainedTokenizerFast``: the 256 bytes (id == byte), then ``family``'s added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    core = Tokenizer(models.BPE(vocab={char: byte for byte, char in _bytes_to_unicode().items()}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.special_tokens])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain_added_tokens])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=spec.bos_token, eos_token=spec.eos_token,
                                   pad_token=spec.pad_token, chat_template=spec.chat_template,
                                   clean_up_tokenization_spaces=False)


def model_config(family: str, tokenizer: Any, *, hidden_size: int = 32, layers: int = 2, context: int = 512,
                 tie_word_embeddings: bool = False) -> Any:
    """A few layers of ``family``'s architecture, the vocabulary rounded up to a multiple of 8."""
    from transformers import LlamaConfig, Qwen3Config

    ids = {name: tokenizer.convert_tokens_to_ids(token) if token else None
           for name, token in (("bos", tokenizer.bos_token), ("eos", tokenizer.eos_token),
                               ("pad", tokenizer.pad_token))}
    common = dict(vocab_size=-(-len(tokenizer) // 8) * 8, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=context, tie_word_embeddings=tie_word_embeddings,
                  bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    if family == "qwen3":
        return Qwen3Config(head_dim=hidden_size // 2, **common)
    return LlamaConfig(**common)


def build_tiny_model(directory: Path, family: str, *, seed: int = 0, **config: Any) -> Path:
    """Save a randomly initialised ``family`` model (``"qwen3"`` or ``"llama"``) with its chat tokenizer in
    ``directory`` (``save_pretrained``), unless one is there; returns the absolute directory."""
    from transformers import AutoModelForCausalLM

    if not (directory / "config.json").is_file():
        tokenizer = chat_tokenizer(family)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(model_config(family, tokenizer, **config))
        model.save_pretrained(str(directory))
        tokenizer.save_pretrained(str(directory))
    return directory.resolve()
