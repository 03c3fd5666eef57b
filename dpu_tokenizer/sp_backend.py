"""Sentencepiece models (.model protobuf files) through the sentencepiece library itself."""

from __future__ import annotations

import re
from pathlib import Path

import sentencepiece as spm

from dpu_tokenizer.base import ByteTableTokenizer, TokenizerError

_SP_SPACE = "\u2581"


class SentencePieceTokenizer(ByteTableTokenizer):
    """Encodes with sentencepiece; control and unknown pieces written in the text are parsed as
    special tokens (as Hugging Face does), and each plain stretch between them is encoded alone."""

    backend_name = "sentencepiece"

    def __init__(self, path: Path) -> None:
        try:
            sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as exc:
            raise TokenizerError(f"cannot load sentencepiece model {path}: {exc}") from exc
        table: list[bytes] = []
        specials: list[int] = []
        for tid in range(sp.get_piece_size()):
            piece = sp.id_to_piece(tid)
            if sp.is_control(tid) or sp.is_unknown(tid):
                specials.append(tid)
                table.append(piece.encode("utf-8"))
            elif sp.is_byte(tid):
                table.append(bytes([int(piece[3:5], 16)]))
            else:
                table.append(piece.replace(_SP_SPACE, " ").encode("utf-8"))
        bos = sp.bos_id() if sp.bos_id() >= 0 else None
        eos = [sp.eos_id()] if sp.eos_id() >= 0 else []
        super().__init__(
            table, specials, bos_token_id=bos, eos_token_ids=eos, prefix_ids=[bos] if bos is not None else []
        )
        self._sp = sp
        probe = sp.encode("a", out_type=str)
        self.strip_leading_space = bool(probe) and probe[0].startswith(_SP_SPACE)
        texts = {sp.id_to_piece(t): t for t in specials if sp.id_to_piece(t)}
        alternatives = sorted(texts, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        self._special_text = texts

    def _encode_plain(self, text: str) -> list[int]:
        found = self._special_re.search(text) if self._special_re is not None else None
        if found is None:
            return self._sp.encode(text)
        out: list[int] = []
        pos = 0
        for match in self._special_re.finditer(text):  # type: ignore[union-attr]
            if match.start() > pos:
                out.extend(self._sp.encode(text[pos : match.start()]))
            out.append(self._special_text[match.group()])
            pos = match.end()
        if pos < len(text):
            out.extend(self._sp.encode(text[pos:]))
        return out

    def _encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        if self._special_re is None or not any(self._special_re.search(t) for t in texts):
            return self._sp.encode(texts, num_threads=2)
        return [self._encode_plain(t) for t in texts]
