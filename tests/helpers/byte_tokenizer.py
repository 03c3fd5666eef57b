"""A stand-in tokenizer for load-generator tests: one token per byte."""

from __future__ import annotations


class ByteTokenizer:
    """One token per byte: enough for prompts whose content does not matter."""

    def encode(self, text: str, **_: object) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], **_: object) -> str:
        return bytes(ids).decode(errors="replace")
