"""Tokenizer benchmark: our encoder against Hugging Face `tokenizers`, plus streaming detokenization.

    python -m bench.tokenizer_bench [--out bench/results/tokenizer.json] [--model DIR ...] [--budget S]

Tokenizers: the embedded SmolLM2 GGUF (HF reference rebuilt from its vocabulary), the Llama-3
`tokenizer.json` from the test assets when present (`python -m dpu_tokenizer.fetch_assets`), and
every `--model` folder holding a `tokenizer.json` (the HF reference is that file).
Rows: inputs of 10, 100, 1000 and 2048 tokens; "single" is one request per call, "batched" is
32 requests per call. Rates are requests per second (tokens/s for detokenization), one process,
best of three rounds of `--budget` / 3 seconds each.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from dpu_tokenizer import load_tokenizer
from dpu_tokenizer.base import ByteTableTokenizer
from dpu_tokenizer.detok import IncrementalDetokenizer
from dpu_tokenizer.fetch_assets import default_assets_dir
from dpu_tokenizer.sources import default_model_path, read_gguf_vocab
from harness.serve_proc import cpu_name

SIZES = (10, 100, 1000, 2048)
BATCH = 32
TEXT = (
    "Serving large language models means turning requests into tokens quickly. "
    "Les modèles de langue traitent du texte; Привет, мир! 你好，世界。 こんにちは 😀👍🏽 "
    "def tokenize(text: str) -> list[int]:\n    return encoder.encode(text)  # 12345 67890\n\n"
)


def _reference_for_default() -> tokenizers.Tokenizer:
    vocab = read_gguf_vocab(str(default_model_path()))
    hf = tokenizers.Tokenizer(
        models.BPE({t: i for i, t in enumerate(vocab.tokens)}, [tuple(m.split(" ")) for m in vocab.merges])
    )
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    hf.decoder = decoders.ByteLevel()
    specials = [t for t, k in zip(vocab.tokens, vocab.token_types, strict=True) if k == 3]
    hf.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials])
    return hf


def _text_of(tok: ByteTableTokenizer, n_tokens: int, salt: int) -> str:
    ids = tok.encode((f"[{salt}] " + TEXT) * (n_tokens // 40 + 2))[:n_tokens]
    return tok.decode(ids)


BUDGET_S = 0.6


def _rate(fn: Callable[[], Any], budget_s: float) -> float:
    """Calls per second, best of three timed rounds."""
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s / 3:
        fn()
        calls += 1
    per_round = max(calls, 1)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        best = max(best, per_round / (time.perf_counter() - t0))
    return best


def _encode_rows(
    name: str, ours: ByteTableTokenizer, hf: tokenizers.Tokenizer, budget: float
) -> list[dict[str, Any]]:
    rows = []
    for size in SIZES:
        texts = [_text_of(ours, size, salt) for salt in range(BATCH)]
        single = texts[0]
        rows.append(
            {
                "tokenizer": name,
                "input_tokens": size,
                "mode": "single",
                "ours_per_s": _rate(lambda s=single: ours.encode(s), budget),
                "hf_per_s": _rate(lambda s=single: hf.encode(s, add_special_tokens=False).ids, budget),
            }
        )
        batched_ours = _rate(lambda t=texts: ours.encode_batch(t), budget) * BATCH
        batched_hf = (
            _rate(lambda t=texts: [e.ids for e in hf.encode_batch(t, add_special_tokens=False)], budget) * BATCH
        )
        rows.append(
            {
                "tokenizer": name,
                "input_tokens": size,
                "mode": "batched",
                "ours_per_s": batched_ours,
                "hf_per_s": batched_hf,
            }
        )
    return rows


def _detok_rates(tok: ByteTableTokenizer, budget: float) -> dict[str, float]:
    ids = tok.encode(TEXT * 400)

    def stream(stops: tuple[str, ...]) -> None:
        det = IncrementalDetokenizer(tok, stop_strings=stops)
        for tid in ids:
            det.push((tid,))
        det.finish()

    return {
        "plain_tokens_per_s": _rate(lambda: stream(()), 2.5 * budget) * len(ids),
        "with_stops_tokens_per_s": _rate(lambda: stream(("\n\nUser:", "</answer>")), 2.5 * budget) * len(ids),
    }


def _models(extra: list[str]) -> list[tuple[str, ByteTableTokenizer, tokenizers.Tokenizer]]:
    out = [("smollm2-gguf", load_tokenizer(), _reference_for_default())]
    folders = [Path(m) for m in extra]
    llama3 = default_assets_dir() / "llama3"
    if (llama3 / "tokenizer.json").is_file() and llama3 not in folders:
        folders.insert(0, llama3)
    for folder in folders:
        name = ("llama3" if folder == llama3 else folder.name) + "-json"
        out.append((name, load_tokenizer(folder), tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))))
    return out


def _encoder_of(tok: ByteTableTokenizer) -> str:
    return tok.backend_name + ("+fastbpe" if getattr(tok, "native", False) else "")


def _print_table(rows: list[dict[str, Any]], detok: dict[str, float]) -> None:
    print(f"{'tokenizer':<22}{'tokens':>7} {'mode':<8}{'ours/s':>12}{'hf/s':>12}{'ratio':>8}")
    for r in rows:
        ratio = r["ours_per_s"] / r["hf_per_s"]
        print(
            f"{r['tokenizer']:<22}{r['input_tokens']:>7} {r['mode']:<8}"
            f"{r['ours_per_s']:>12.0f}{r['hf_per_s']:>12.0f}{ratio:>7.1f}x"
        )
    for key, value in detok.items():
        print(f"detokenize {key}: {value:,.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/tokenizer.json")
    parser.add_argument("--model", action="append", default=[], help="a folder with a tokenizer.json")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds per measured rate")
    args = parser.parse_args(argv)
    models = _models(args.model)
    rows = [row for name, ours, hf in models for row in _encode_rows(name, ours, hf, args.budget)]
    detok = _detok_rates(models[0][1], args.budget)
    _print_table(rows, detok)
    result = {
        "cpu": cpu_name(),
        "backend": {name: _encoder_of(ours) for name, ours, _ in models},
        "budget_s": args.budget,
        "rows": rows,
        "detokenize": detok,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
