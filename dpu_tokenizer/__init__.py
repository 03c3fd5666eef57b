"""Frontend tokenizer library: exact fast encoders, chat templates and streaming detokenization."""

from dpu_tokenizer.base import ByteTableTokenizer, Tokenizer, TokenizerError
from dpu_tokenizer.chat import ChatTemplateError, load_chat_template, render_chat
from dpu_tokenizer.detok import IncrementalDetokenizer
from dpu_tokenizer.loader import load_tokenizer

__all__ = [
    "ByteTableTokenizer",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_chat_template",
    "load_tokenizer",
    "render_chat",
]
