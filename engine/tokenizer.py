"""Text tokenizers: the byte-level BPE described by a GGUF's metadata, or a ``tokenizer.json``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

_CONTROL = 3  # llama.cpp token type of special tokens such as <|endoftext|>
# llama.cpp pre-tokenizers reproduced exactly: GPT-2's regex, after splitting digits one by one ("smollm").
PRE_TOKENIZERS = ("default", "gpt2", "smollm")


@dataclass(frozen=True)
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus the ids of its BOS/EOS tokens."""

    backend: _HFTokenizer
    bos_token_id: int | None
    eos_token_id: int | None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS added)."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> TextTokenizer:
    """Byte-level BPE from ``tokenizer.ggml.{tokens,merges,token_type}`` (``tokenizer.ggml.model`` gpt2)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(f"GGUF tokenizer.ggml.model={kind!r} is not supported (supported: 'gpt2')")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "gpt2")))
    backend.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    specials = [
        AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL
    ]
    backend.add_special_tokens(specials)
    return TextTokenizer(
        backend, meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    )


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    if name not in PRE_TOKENIZERS:
        raise NotImplementedError(
            f"GGUF tokenizer.ggml.pre={name!r} is not supported (supported: {PRE_TOKENIZERS})"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name != "smollm":
        return byte_level
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])


def tokenizer_from_file(
    path: str | Path, bos_token_id: int | None, eos_token_id: int | None
) -> TextTokenizer:
    """A ``tokenizer.json`` as saved by Hugging Face."""
    return TextTokenizer(_HFTokenizer.from_file(str(path)), bos_token_id, eos_token_id)
