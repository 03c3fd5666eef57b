"""Turn a merge-list BPE vocabulary (Hugging Face / GGUF style) into tiktoken ranks, exactly or not at all.

tiktoken merges, at every step, the adjacent pair whose concatenation has the lowest rank; merge-list
BPE merges the adjacent pair with the lowest merge index, and only pairs listed as merges. The two
agree when every merged token is produced, from its own bytes, by the rank rule through its own
merge: ``check_merges`` verifies exactly that before a rank encoder is trusted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dpu_tokenizer.bytelevel import token_to_bytes


@dataclass
class RankPlan:
    """tiktoken inputs derived from a vocabulary, and what keeps them from being exact."""

    ranks: dict[bytes, int]
    rank_to_id: list[int] | None
    missing_bytes: list[int]
    problems: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.problems


def _split_merge(merge: str | Sequence[str]) -> tuple[str, str]:
    if isinstance(merge, str):
        left, _, right = merge.partition(" ")
        return left, right
    return merge[0], merge[1]


def _merged_ids(
    tokens: Sequence[str], ids: dict[str, int], merges: Sequence[str | Sequence[str]], problems: list[str]
) -> list[tuple[int, list[tuple[bytes, bytes]]]]:
    """(id of the merged token, every (left, right) split listed for it) in merge order.

    A token may be listed by several merges (vocabularies converted from tiktoken list every
    split); rank BPE can only mirror that when those merges are consecutive in priority.
    """
    out: list[tuple[int, list[tuple[bytes, bytes]]]] = []
    for merge in merges:
        left, right = _split_merge(merge)
        tid = ids.get(left + right)
        lb, rb = token_to_bytes(left), token_to_bytes(right)
        if tid is None or lb is None or rb is None:
            problems.append(f"merge {left!r} {right!r} does not map to a byte-level vocabulary token")
        elif out and out[-1][0] == tid:
            out[-1][1].append((lb, rb))
        else:
            out.append((tid, [(lb, rb)]))
    if len({tid for tid, _ in out}) != len(out):
        problems.append("a token is produced by merges that are not consecutive in priority")
    return out


def plan_ranks(
    tokens: Sequence[str],
    merges: Sequence[str | Sequence[str]],
    special_ids: set[int],
    *,
    ignore_merges: bool = False,
) -> RankPlan:
    """Ranks for ``tokens`` (id -> byte-level token string) given ``merges`` in priority order."""
    problems: list[str] = []
    ids = {tok: i for i, tok in enumerate(tokens) if i not in special_ids}
    merged = _merged_ids(tokens, ids, merges, problems)
    merged_set = {tid for tid, _ in merged}
    ranks: dict[bytes, int] = {}
    singles: list[int] = []
    for tid, tok in enumerate(tokens):
        if not tok or tid in special_ids or tid in merged_set:
            continue
        raw = token_to_bytes(tok)
        if raw is None:
            problems.append(f"token {tok!r} is not written in the byte-level alphabet")
        elif len(raw) == 1:
            ranks[raw] = tid
            singles.append(tid)
        elif ignore_merges:
            problems.append(f"token {tok!r} is reachable only as a whole word")
    monotone = all(a[0] < b[0] for a, b in zip(merged, merged[1:], strict=False))
    rank_to_id: list[int] | None = None
    if monotone:
        for tid, splits in merged:
            ranks[b"".join(splits[0])] = tid
    else:
        rank_to_id = sorted(singles) + [tid for tid, _ in merged]
        ranks = {raw: rank for rank, raw in enumerate(sorted(ranks, key=ranks.__getitem__))}
        for rank, (_, splits) in enumerate(merged, start=len(singles)):
            ranks[b"".join(splits[0])] = rank
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    blocks = [splits for _, splits in merged]
    unreached = check_merges(ranks, blocks)
    if unreached and not (ignore_merges and not check_all_splits_listed(ranks, blocks)):
        problems.extend(unreached)
    return RankPlan(ranks, rank_to_id, missing, problems)


def _rank_bpe(piece: bytes, ranks: dict[bytes, int]) -> tuple[list[bytes], tuple[bytes, bytes] | None]:
    """Plain rank-rule BPE of ``piece``; returns the parts and the last pair merged."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    last: tuple[bytes, bytes] | None = None
    while len(parts) > 1:
        best_rank, best_i = -1, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_i < 0 or rank < best_rank):
                best_rank, best_i = rank, i
        if best_i < 0:
            break
        last = (parts[best_i], parts[best_i + 1])
        parts[best_i : best_i + 2] = [last[0] + last[1]]
    return parts, last


def check_merges(
    ranks: dict[bytes, int], merges: Sequence[Sequence[tuple[bytes, bytes]]], limit: int = 5
) -> list[str]:
    """Merged tokens that the rank rule would not build, from their own bytes, through a listed split."""
    bad: list[str] = []
    for splits in merges:
        whole = b"".join(splits[0])
        if len(whole) == 2:
            continue  # a pair of single bytes can only be merged one way
        parts, last = _rank_bpe(whole, ranks)
        if len(parts) != 1 or last not in splits:
            bad.append(f"merge {splits[0][0]!r}+{splits[0][1]!r} is reached through {last!r}")
            if len(bad) >= limit:
                break
    return bad


def check_all_splits_listed(
    ranks: dict[bytes, int], merges: Sequence[Sequence[tuple[bytes, bytes]]], limit: int = 5
) -> list[str]:
    """Splits of a merged token into two known tokens that are not listed as its merges.

    Vocabularies converted from tiktoken list every such split; then the merge-list rule and the
    rank rule agree on which adjacent pairs merge, and in which order (the whole-word shortcut of
    ``ignore_merges`` covering tokens that no merge sequence reaches).
    """
    bad: list[str] = []
    for splits in merges:
        whole = b"".join(splits[0])
        listed = set(splits)
        for cut in range(1, len(whole)):
            left, right = whole[:cut], whole[cut:]
            if left in ranks and right in ranks and (left, right) not in listed:
                bad.append(f"split {left!r}+{right!r} of {whole!r} is not a listed merge")
                if len(bad) >= limit:
                    return bad
    return bad
