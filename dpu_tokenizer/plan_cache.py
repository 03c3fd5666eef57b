"""A per-user cache of rank plans: checking that a 49k-merge vocabulary can be encoded by the rank rule
takes seconds (`rankbpe.check_merges` runs BPE over every merged token), and every start of the tokenizer
service repeated it for the same file.

A plan is stored under ``$XDG_CACHE_HOME/blink/rank-plans`` (default ``~/.cache``), named by a SHA-256 of
everything it depends on: the tokens, the merges, the special ids, the ``ignore_merges`` flag and the source
of ``rankbpe.py`` itself, so a changed planner never reads an old plan. Plans are written with ``marshal``
(plain data only: no code is loaded), in a directory only the user can write, atomically (write, then
rename). Any problem with the cache (no home, a read-only disk, a damaged file) only costs the computation.
``BLINK_RANK_PLAN_CACHE=0`` turns it off (``shared.env``).
"""

from __future__ import annotations

import contextlib
import hashlib
import marshal
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dpu_tokenizer import rankbpe
from dpu_tokenizer.rankbpe import RankPlan, plan_ranks
from shared.env import env

_SOURCE_DIGEST = hashlib.sha256(Path(rankbpe.__file__).read_bytes()).hexdigest()


def cache_dir() -> Path | None:
    if not env().rank_plan_cache:
        return None
    base = os.environ.get("XDG_CACHE_HOME") or (os.path.join(os.path.expanduser("~"), ".cache"))
    return None if base.startswith("~") else Path(base) / "blink" / "rank-plans"


def plan_key(tokens: Sequence[str], merges: Sequence[str | Sequence[str]], special_ids: set[int],
             ignore_merges: bool) -> str:
    h = hashlib.sha256(_SOURCE_DIGEST.encode())
    for part in (tokens, [m if isinstance(m, str) else " ".join(m) for m in merges]):
        h.update(len(part).to_bytes(8, "little"))
        h.update("\0".join(part).encode("utf-8", errors="surrogatepass"))
    h.update(repr((sorted(special_ids), ignore_merges)).encode())
    return h.hexdigest()


def _load(path: Path) -> RankPlan | None:
    with contextlib.suppress(OSError, EOFError, ValueError, TypeError):
        if path.stat().st_uid != os.getuid():
            return None  # written by someone else: not ours to trust
        ranks, rank_to_id, missing, problems = marshal.loads(path.read_bytes())
        if isinstance(ranks, dict) and isinstance(missing, list) and isinstance(problems, list):
            return RankPlan(ranks, rank_to_id, missing, problems)
    return None


def _store(folder: Path, path: Path, plan: RankPlan) -> None:
    with contextlib.suppress(OSError):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if folder.stat().st_uid != os.getuid():
            return
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".plan-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(marshal.dumps((plan.ranks, plan.rank_to_id, plan.missing_bytes, plan.problems)))
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def cached_plan_ranks(tokens: Sequence[str], merges: Sequence[str | Sequence[str]], special_ids: set[int], *,
                      ignore_merges: bool = False) -> RankPlan:
    """``rankbpe.plan_ranks``, from the cache when the same inputs were planned before."""
    folder = cache_dir()
    if folder is None:
        return plan_ranks(tokens, merges, special_ids, ignore_merges=ignore_merges)
    path = folder / f"{plan_key(tokens, merges, special_ids, ignore_merges)}.marshal"
    plan = _load(path)
    if plan is None:
        plan = plan_ranks(tokens, merges, special_ids, ignore_merges=ignore_merges)
        _store(folder, path, plan)
    return plan
