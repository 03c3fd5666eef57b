"""The exact fallback: Hugging Face ``tokenizers`` (Rust), used where a faster encoder would not be exact."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from dpu_tokenizer.base import ByteTableTokenizer
from dpu_tokenizer.bytelevel import token_to_bytes

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _piece_bytes(token: str, byte_level: bool) -> bytes:
    """Best-effort raw bytes of a vocabulary entry (byte-level, metaspace or byte-fallback style)."""
    if byte_level:
        raw = token_to_bytes(token)
        if raw is not None:
            return raw
    match = _BYTE_PIECE.fullmatch(token)
    if match is not None:
        return bytes([int(match.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


class HFTokenizer(ByteTableTokenizer):
    """Wraps ``tokenizers.Tokenizer``; encode and decode go through it, token bytes come from its vocab."""

    backend_name = "hf-tokenizers"

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        byte_level: bool,
        wrap_ids: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> None:
        size = hf.get_vocab_size(with_added_tokens=True)
        vocab = hf.get_vocab(with_added_tokens=True)
        size = max(size, max(vocab.values(), default=-1) + 1)
        table = [b""] * size
        for token, tid in vocab.items():
            table[tid] = _piece_bytes(token, byte_level)
        specials = []
        for tid, added in hf.get_added_tokens_decoder().items():
            table[tid] = added.content.encode("utf-8")
            if added.special:
                specials.append(tid)
        prefix, suffix = wrap_ids if wrap_ids is not None else _probe_wrap(hf)
        super().__init__(
            table,
            specials,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            prefix_ids=prefix,
            suffix_ids=suffix,
        )
        self._hf = hf
        self._byte_level = byte_level

    def _encode_plain(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def _encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self._hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if self._byte_level:
            return super().decode(ids, skip_special_tokens=skip_special_tokens)
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _probe_wrap(hf: tokenizers.Tokenizer) -> tuple[list[int], list[int]]:
    """Ids the post-processor puts around a sequence when special tokens are added."""
    plain = hf.encode("a", add_special_tokens=False).ids
    full = hf.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


def build_bytelevel_bpe(
    tokens: Sequence[str],
    merges: Sequence[str],
    added: dict[str, int],
    special_ids: set[int],
    pre_tokenizer: pre_tokenizers.PreTokenizer,
    *,
    ignore_merges: bool = False,
) -> tokenizers.Tokenizer:
    """A Hugging Face byte-level BPE tokenizer from a vocabulary listing (as GGUF files carry it)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs: list[tuple[str, str]] = [(a, b) for a, _, b in (m.partition(" ") for m in merges)]
    hf = tokenizers.Tokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    hf.pre_tokenizer = pre_tokenizer
    hf.decoder = decoders.ByteLevel()
    entries = {
        t: tokenizers.AddedToken(t, special=i in special_ids, normalized=False) for t, i in added.items()
    }
    hf.add_special_tokens([e for t, e in entries.items() if added[t] in special_ids])
    hf.add_tokens([e for t, e in entries.items() if added[t] not in special_ids])
    return hf


def gguf_pre_tokenizer(pattern: str, digits: bool) -> pre_tokenizers.PreTokenizer:
    """The Hugging Face pre-tokenizer equivalent to a GGUF ``tokenizer.ggml.pre`` pattern."""
    if digits:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
