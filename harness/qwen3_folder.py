"""A Qwen3 model folder from the tokenizer assets: ``tokenizer.json`` written from Qwen's tiktoken rank file
(``qwen/qwen.tiktoken``, the byte-level BPE Qwen2 and Qwen3 share), Qwen3's 26 added tokens, a
``tokenizer_config.json`` with a ChatML chat template, and a ``generation_config.json`` of ids only.

vLLM (through transformers) reads ``tokenizer.json``; Blink reads it too and, the pipeline being plain byte-level
BPE, encodes through tiktoken. The merges are recovered from the ranks: a token of rank r is the pair that BPE
limited to ranks below r leaves of its bytes (the usual conversion of a tiktoken file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpu_tokenizer.bytelevel import QWEN_PATTERN, byte_to_char
from dpu_tokenizer.sources import read_tiktoken_ranks

QWEN_RANKS = 151643  # regular tokens of qwen.tiktoken; the added ones follow
QWEN3_ADDED = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> "
    "<|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|> "
    "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> "
    "<|file_sep|> <tool_response> </tool_response> <think> </think>"
).split()
# Special in Qwen3's tokenizer (skipped when decoding); the tool and think markers are plain added tokens.
QWEN3_NOT_SPECIAL = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                               "</think>"})
ENDOFTEXT, IM_END = QWEN_RANKS, QWEN_RANKS + 2
# ChatML as Qwen3 writes it, without tools: each message between <|im_start|>ROLE and <|im_end|>; the generation
# prompt opens the assistant's turn, with an empty reasoning block when enable_thinking is false.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def qwen_ranks_file(assets_dir: Path) -> Path:
    """``qwen/qwen.tiktoken`` under the assets folder (or the folder itself)."""
    for path in (assets_dir / "qwen" / "qwen.tiktoken", assets_dir / "qwen.tiktoken"):
        if path.is_file():
            return path
    raise FileNotFoundError(f"no qwen/qwen.tiktoken under {assets_dir}; fetch it with: python -m "
                            f"dpu_tokenizer.fetch_assets {assets_dir}")


def split_of(token: bytes, rank: int, ranks: dict[bytes, int]) -> list[bytes]:
    """``token``'s bytes merged by BPE with only the ranks below ``rank``: the merge that makes it is the pair
    left (two parts for every token of a tiktoken file but single bytes)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best, at = rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[list[str]]]:
    """Byte-level BPE's vocabulary (GPT-2 alphabet) and merges, in rank order, from tiktoken ranks."""
    alphabet = byte_to_char()

    def text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges: list[list[str]] = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        parts = split_of(tok, rank, ranks)
        if len(parts) != 2:
            raise ValueError(f"rank {rank} ({tok!r}) is no merge of two lower-ranked tokens: {parts}")
        merges.append([text(parts[0]), text(parts[1])])
    return vocab, merges


def tokenizer_json(ranks: dict[bytes, int]) -> dict[str, Any]:
    """Qwen3's ``tokenizer.json``: NFC, the Qwen split then byte-level, BPE, Qwen3's added tokens."""
    if len(ranks) != QWEN_RANKS:
        raise ValueError(f"expected Qwen's {QWEN_RANKS} ranks, got {len(ranks)}")
    vocab, merges = vocab_and_merges(ranks)
    added = [{"id": QWEN_RANKS + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": t not in QWEN3_NOT_SPECIAL} for i, t in enumerate(QWEN3_ADDED)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": byte_level,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def tokenizer_config() -> dict[str, Any]:
    """What transformers (and so vLLM) needs beside ``tokenizer.json``, with the chat template."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "model_max_length": 131072, "clean_up_tokenization_spaces": False,
            "split_special_tokens": False, "chat_template": CHAT_TEMPLATE}


def write_qwen3_tokenizer(assets_dir: Path, folder: Path) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` (ids only: no sampling
    defaults for either server to pick up) into ``folder``."""
    ranks = read_tiktoken_ranks(qwen_ranks_file(assets_dir))
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(ranks), ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1) + "\n")
    ids = {"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT], "pad_token_id": ENDOFTEXT}
    (folder / "generation_config.json").write_text(json.dumps(ids, indent=1) + "\n")
