"""A Hugging Face tokenizer for the byte-level models: token id == byte value, nothing downloaded.

The built-in models have no tokenizer files anywhere, yet clients (the SDK's ``get_tokenizer``,
tinker-cookbook's ``get_tokenizer``) expect a ``transformers`` tokenizer. This builds one from
the ``tokenizers`` library: 256 single-byte tokens under the usual byte-to-unicode mapping, no
merges and no special tokens, so ``encode(text) == list(text.encode())``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


@lru_cache(maxsize=1)
def byte_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` whose ids are the UTF-8 bytes of the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False)


def write_byte_tokenizer(directory: Path) -> Path:
    """Save the tokenizer where ``AutoTokenizer.from_pretrained(directory)`` finds it; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "tokenizer.json").is_file():
        byte_tokenizer().save_pretrained(str(directory))
    return directory
