"""Common tokenizer interface and the byte-table machinery shared by every backend."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What the frontend needs from a tokenizer, whatever encodes underneath."""

    backend_name: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def encode_batch(self, texts: list[str], *, add_special_tokens: bool = False) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


class TokenizerError(ValueError):
    """A tokenizer's files are missing, unreadable or of a kind this library cannot encode exactly."""


class ByteTableTokenizer:
    """Decoding, token bytes and special-token bookkeeping from one table of raw token bytes.

    ``table[i]`` holds the raw bytes of token ``i``; special tokens hold their UTF-8 text.
    Subclasses implement ``_encode_plain`` and may set ``strip_leading_space`` when the
    decoder drops one leading space from the whole output (sentencepiece dummy prefix).
    """

    backend_name: str = "base"
    strip_leading_space: bool = False

    def __init__(
        self,
        table: list[bytes],
        special_ids: Iterable[int],
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        prefix_ids: Sequence[int] = (),
        suffix_ids: Sequence[int] = (),
    ) -> None:
        self._table = table
        self._special = frozenset(special_ids)
        self._table_skip = list(table)
        for tid in self._special:
            self._table_skip[tid] = b""
        self.vocab_size = len(table)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._prefix_ids = list(prefix_ids)
        self._suffix_ids = list(suffix_ids)

    # -- encoding -------------------------------------------------------------------------------
    def _encode_plain(self, text: str) -> list[int]:
        raise NotImplementedError

    def _encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._encode_plain(t) for t in texts]

    def _wrap(self, ids: list[int]) -> list[int]:
        if self._prefix_ids:
            ids[:0] = self._prefix_ids
        if self._suffix_ids:
            ids.extend(self._suffix_ids)
        return ids

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids = self._encode_plain(text)
        return self._wrap(ids) if add_special_tokens else ids

    def encode_batch(self, texts: list[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        out = self._encode_plain_batch(texts)
        if add_special_tokens:
            out = [self._wrap(ids) for ids in out]
        return out

    # -- decoding -------------------------------------------------------------------------------
    def token_bytes_table(self, *, skip_special_tokens: bool = True) -> Sequence[bytes]:
        """The whole id -> bytes table (read-only by convention); the detokenizer's fast path."""
        return self._table_skip if skip_special_tokens else self._table

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = False) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} outside the vocabulary (size {self.vocab_size})")
        return (self._table_skip if skip_special_tokens else self._table)[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def decode_bytes(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> bytes:
        table = self._table_skip if skip_special_tokens else self._table
        try:
            return b"".join([table[i] for i in ids])
        except (IndexError, TypeError):
            size = len(table)
            return b"".join([table[i] for i in ids if 0 <= int(i) < size])

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        data = self.decode_bytes(ids, skip_special_tokens=skip_special_tokens)
        if self.strip_leading_space and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", "replace")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend_name} vocab_size={self.vocab_size}>"
