"""The embedded SmolLM2 GGUF tokenizer: our fast encoder against a Hugging Face `tokenizers` reference."""

from __future__ import annotations

import random

import pytest
import tokenizers
from test_tokenizer_corpus import make_corpus
from tokenizers import decoders, models, pre_tokenizers

from dpu_tokenizer import Tokenizer, load_tokenizer
from dpu_tokenizer.sources import default_model_path, read_gguf_vocab


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def reference() -> tokenizers.Tokenizer:
    """SmolLM2's tokenizer.json pipeline (Digits + ByteLevel BPE), rebuilt from the GGUF vocabulary."""
    vocab = read_gguf_vocab(str(default_model_path()))
    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ")) for m in vocab.merges]
    hf = tokenizers.Tokenizer(models.BPE(ids, merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    hf.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind == 3]
    hf.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in control])
    return hf


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return make_corpus()


def test_backend_and_metadata(ours: Tokenizer) -> None:
    assert ours.backend_name == "tiktoken"
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1
    assert ours.eos_token_ids == (2,)
    assert isinstance(ours, Tokenizer)


def test_encode_matches_reference_on_corpus(
    ours: Tokenizer, reference: tokenizers.Tokenizer, corpus: list[str]
) -> None:
    expected = [e.ids for e in reference.encode_batch(corpus, add_special_tokens=False)]
    mismatches = [
        (s, ours.encode(s), ids) for s, ids in zip(corpus, expected, strict=True) if ours.encode(s) != ids
    ]
    assert not mismatches[:3], f"{len(mismatches)} mismatches"
    assert ours.encode_batch(corpus) == expected


def test_encode_matches_reference_on_vocabulary(ours: Tokenizer, reference: tokenizers.Tokenizer) -> None:
    """Every token's own text, bare and inside context, encodes identically."""
    texts = []
    for tid in range(ours.vocab_size):
        text = ours.token_bytes(tid).decode("utf-8", "replace")
        texts.extend((text, f"x{text}1 {text}"))
    expected = [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]
    assert ours.encode_batch(texts) == expected


def test_long_texts_match_reference(
    ours: Tokenizer, reference: tokenizers.Tokenizer, corpus: list[str]
) -> None:
    texts = [" ".join(corpus[i : i + 300]) for i in range(0, 6000, 300)]
    assert all(len(t) > 6000 for t in texts)
    expected = [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]
    assert [ours.encode(t) for t in texts] == expected


def test_special_tokens_parsed_in_text(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert ours.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    assert 1 not in ours.encode("<|im_start")
    assert ours.encode("x", add_special_tokens=True) == ours.encode("x")  # SmolLM2 adds no BOS
    assert ours.is_special(0) and ours.is_special(2) and not ours.is_special(100)


def test_bytes_missing_from_vocabulary_use_exact_path(
    ours: Tokenizer, reference: tokenizers.Tokenizer
) -> None:
    for text in ("a\x04b", "!!\x04!!", "x\U00050000y", "\x1d\x1d", "plain text \x13 more"):
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_roundtrip_and_decode_match_reference(
    ours: Tokenizer, reference: tokenizers.Tokenizer, corpus: list[str]
) -> None:
    for text in corpus[:4000]:
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )
        if not any(ch in text for ch in "\x04\x06\x13\x14\x16\x1d") and "\U00050000" not in text:
            assert ours.decode(ids, skip_special_tokens=False) == text


def test_decode_of_arbitrary_ids_matches_reference(ours: Tokenizer, reference: tokenizers.Tokenizer) -> None:
    rnd = random.Random(7)
    for _ in range(2000):
        ids = [rnd.randrange(ours.vocab_size) for _ in range(rnd.randint(1, 12))]
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), ids


def test_token_bytes(ours: Tokenizer) -> None:
    ids = ours.encode("héllo 😀")
    assert b"".join(ours.token_bytes(i) for i in ids) == "héllo 😀".encode()
    assert ours.token_bytes(1) == b"<|im_start|>"
    with pytest.raises(IndexError):
        ours.token_bytes(ours.vocab_size)
