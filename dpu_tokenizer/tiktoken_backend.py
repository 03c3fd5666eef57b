"""The fast path: our C byte-level BPE (``fastbpe``) where it implements the model's pre-tokenizer
pattern, tiktoken's Rust BPE with the pattern and added tokens otherwise (and as its fallback)."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from typing import Any

import tiktoken

from dpu_tokenizer.base import ByteTableTokenizer
from dpu_tokenizer.bytelevel import missing_bytes_guard
from dpu_tokenizer.fastbpe import build_encoder


def _has_prefix_clash(words: Iterable[str]) -> bool:
    ordered = sorted(words)
    return any(b.startswith(a) for a, b in zip(ordered, ordered[1:], strict=False))


class TiktokenTokenizer(ByteTableTokenizer):
    """Byte-level BPE through the C encoder, else ``tiktoken.Encoding``.

    The C encoder answers None for the texts it cannot vouch for (chars unassigned in Python's
    Unicode tables, bytes missing from the vocabulary, lone surrogates); those take the tiktoken
    path, which routes them on to the exact fallback where needed.

    ``added`` maps every added-token text that must be matched inside input text to its id
    (special or not); ``rank_to_id`` translates ranks when they differ from vocabulary ids.
    ``exact_fallback`` builds an exact encoder for inputs containing bytes the vocabulary lacks.
    """

    backend_name = "tiktoken"

    def __init__(
        self,
        *,
        name: str,
        pattern: str,
        ranks: dict[bytes, int],
        added: dict[str, int],
        table: list[bytes],
        special_ids: Iterable[int],
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        prefix_ids: Sequence[int] = (),
        suffix_ids: Sequence[int] = (),
        rank_to_id: list[int] | None = None,
        missing_bytes: Sequence[int] = (),
        exact_fallback: Callable[[], ByteTableTokenizer] | None = None,
        nfc: bool = False,
    ) -> None:
        super().__init__(
            table,
            special_ids,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            prefix_ids=prefix_ids,
            suffix_ids=suffix_ids,
        )
        ranks = dict(ranks)
        enc_added = dict(added)
        vocab_rank_to_id = rank_to_id  # before the added tokens are appended to the copy below
        if rank_to_id is not None:
            rank_to_id = list(rank_to_id)
            for text, tid in added.items():
                enc_added[text] = len(rank_to_id)
                rank_to_id.append(tid)
        top = max([*ranks.values(), *enc_added.values()], default=-1)
        for extra, byte in enumerate(missing_bytes, start=top + 1):
            ranks.setdefault(bytes([byte]), extra)  # never emitted: the guard routes such text away
        self._enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=enc_added)
        self._allowed = frozenset(added)
        self._rank_to_id = rank_to_id
        self._guard = missing_bytes_guard(missing_bytes)
        self._fallback_factory = exact_fallback
        self._nfc = nfc
        self._python_split = nfc or _has_prefix_clash(added)
        alternatives = sorted(added, key=len, reverse=True)
        self._added_re = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        self._added = enc_added
        self._core = self._enc._core_bpe  # the Rust encoder; skips per-call argument checks
        self._first_chars = frozenset(t[0] for t in added if t)
        # built at the first encode: a process that only decodes (a gateway) never pays for it
        self._native_args = (pattern, ranks, added, vocab_rank_to_id, missing_bytes, len(table))

    @cached_property
    def _native(self) -> Any:  # a _fastbpe.Encoder, or None
        pattern, ranks, added, rank_to_id, missing_bytes, vocab_size = self._native_args
        return build_encoder(pattern, ranks, added, rank_to_id=rank_to_id, missing_bytes=missing_bytes,
                             vocab_size=vocab_size)

    @property
    def native(self) -> bool:
        """Whether the C encoder (``fastbpe``) encodes this vocabulary's texts (builds it on first use)."""
        return self._native is not None

    @cached_property
    def _fallback(self) -> ByteTableTokenizer:
        if self._fallback_factory is None:
            raise ValueError("text holds bytes missing from the vocabulary and no exact fallback exists")
        return self._fallback_factory()

    def _split_encode(self, text: str) -> list[int]:
        """Added tokens split out in Python (longest match first), each plain piece encoded alone."""
        out: list[int] = []
        pos = 0
        matches = self._added_re.finditer(text) if self._added_re is not None else ()
        for match in matches:
            out.extend(self._ordinary(text[pos : match.start()]))
            out.append(self._added[match.group()])
            pos = match.end()
        out.extend(self._ordinary(text[pos:]))
        return out

    def _ordinary(self, piece: str) -> list[int]:
        if not piece:
            return []
        if self._nfc:
            piece = unicodedata.normalize("NFC", piece)
        return self._enc.encode_ordinary(piece)

    def _encode_plain(self, text: str) -> list[int]:
        native = self._native
        # an NFC vocabulary: the C encoder vouches only for texts already in NFC
        ok = native is not None and not (self._nfc and not unicodedata.is_normalized("NFC", text))
        ids = native.encode(text) if ok else None  # type: ignore[union-attr]
        return ids if ids is not None else self._encode_tiktoken(text)

    def _encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        if self._native is None or self._nfc:
            return super()._encode_plain_batch(texts)
        out = self._native.encode_batch(texts)
        return [ids if ids is not None else self._encode_tiktoken(t) for ids, t in zip(out, texts, strict=True)]

    def _encode_tiktoken(self, text: str) -> list[int]:
        if self._guard is not None and self._guard.search(text) is not None:
            return self._fallback.encode(text)
        return self._encode_piece(text)

    def _encode_piece(self, text: str) -> list[int]:
        try:
            ids = self._encode_ranks(text)
        except UnicodeEncodeError:  # lone surrogates: replaced, as tiktoken's own wrapper does
            ids = self._encode_ranks(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))
        rank_to_id = self._rank_to_id
        return ids if rank_to_id is None else [rank_to_id[r] for r in ids]

    def _encode_ranks(self, text: str) -> list[int]:
        if self._python_split and not (self._nfc and unicodedata.is_normalized("NFC", text)):
            return self._split_encode(text)
        if any(c in text for c in self._first_chars):
            return self._core.encode(text, self._allowed)
        return self._core.encode_ordinary(text)
