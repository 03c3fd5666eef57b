"""The per-user cache of rank plans: same plan as computing it, never a stale or foreign one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dpu_tokenizer import plan_cache
from dpu_tokenizer.rankbpe import plan_ranks
from dpu_tokenizer.sources import default_model_path, read_gguf_vocab
from shared import env


@pytest.fixture
def vocab() -> tuple[list[str], list[str]]:
    try:
        v = read_gguf_vocab(str(default_model_path()))
    except Exception as exc:  # noqa: BLE001 - the embedded model package is optional
        pytest.skip(f"embedded model not installed: {exc}")
    return v.tokens, v.merges


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.marshal"))


def test_a_cached_plan_equals_the_computed_one(vocab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tokens, merges = vocab
    first = plan_cache.cached_plan_ranks(tokens, merges, {0})
    (stored,) = files(tmp_path / "blink" / "rank-plans")
    assert stored.stat().st_mode & 0o077 == 0 and (tmp_path / "blink" / "rank-plans").stat().st_mode & 0o077 == 0
    again = plan_cache.cached_plan_ranks(tokens, merges, {0})
    direct = plan_ranks(tokens, merges, {0})
    for plan in (first, again):
        assert (plan.ranks, plan.rank_to_id, plan.missing_bytes, plan.problems) == (
            direct.ranks, direct.rank_to_id, direct.missing_bytes, direct.problems)
    # other inputs are another plan
    plan_cache.cached_plan_ranks(tokens, merges[:-1], {0})
    plan_cache.cached_plan_ranks(tokens, merges, {0, 1})
    assert len(files(tmp_path / "blink" / "rank-plans")) == 3


def test_a_damaged_or_foreign_file_is_recomputed(vocab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tokens, merges = vocab
    plan_cache.cached_plan_ranks(tokens, merges, set())
    (stored,) = files(tmp_path / "blink" / "rank-plans")
    stored.write_bytes(b"\x00garbage")
    plan = plan_cache.cached_plan_ranks(tokens, merges, set())
    assert plan.ranks == plan_ranks(tokens, merges, set()).ranks
    assert stored.read_bytes() != b"\x00garbage"  # rewritten
    if os.getuid() == 0:  # a plan owned by another user is not trusted
        os.chown(stored, 12345, 12345)
        assert plan_cache._load(stored) is None


def test_off_switch(vocab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(env, "_ENV", env.Env.from_environ({"BLINK_RANK_PLAN_CACHE": "0"}))
    tokens, merges = vocab
    assert plan_cache.cached_plan_ranks(tokens, merges, set()).exact
    assert not (tmp_path / "blink").exists()
