"""Bare tiktoken rank files carry no pattern and no special tokens: the known families supply them.

A family is recognised by the number of ranks in its file; its added tokens follow the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpu_tokenizer.bytelevel import LLAMA3_PATTERN, QWEN35_PATTERN, QWEN_PATTERN


@dataclass(frozen=True)
class RankFamily:
    name: str
    pattern: str
    specials: tuple[str, ...]
    bos: str | None
    eos: tuple[str, ...]


def _llama3_specials() -> tuple[str, ...]:
    named = {0: "begin_of_text", 1: "end_of_text", 6: "start_header_id", 7: "end_header_id", 9: "eot_id"}
    out: list[str] = []
    reserved = 0
    for slot in range(256):
        if slot in named:
            out.append(f"<|{named[slot]}|>")
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return tuple(out)


_QWEN_BASE = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN35_NAMES = (
    "<|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> <|quad_start|> <|quad_end|> "
    "<|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|> <tool_call> </tool_call> "
    "<|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <tool_response> "
    "</tool_response> <think> </think> <|audio_start|> <|audio_end|> <tts_pad> <tts_text_bos> "
    "<tts_text_eod> <tts_text_bos_single> <|audio_pad|>"
).split()

RANK_FAMILIES: dict[int, RankFamily] = {
    128000: RankFamily(
        "llama3", LLAMA3_PATTERN, _llama3_specials(), "<|begin_of_text|>", ("<|end_of_text|>", "<|eot_id|>")
    ),
    151643: RankFamily(
        "qwen",
        QWEN_PATTERN,
        _QWEN_BASE + tuple(f"<|extra_{i}|>" for i in range(205)),
        None,
        ("<|endoftext|>", "<|im_end|>"),
    ),
    248044: RankFamily(
        "qwen3.5", QWEN35_PATTERN, _QWEN_BASE + tuple(_QWEN35_NAMES), None, ("<|endoftext|>", "<|im_end|>")
    ),
}
