"""The shapes of the chunked-prefill (mixed-step) graphs: which (rows, tokens) the GPU backends capture.

A mixed step carries the running decodes (a token each) and prompt chunks, up to the token budget; it runs
the cheapest captured graph that holds it (``GraphCache.prefill_table``), computing the graph's tokens, so
the tokens between the step's and the graph's are padding (``RingHeader.padded_tokens`` counts them). Two
grids, ``MIXED_GRIDS``, while both are measured on a GPU (``BLINK_TOKEN_GRID``); the slower one then goes.
"""

from __future__ import annotations

from gpu_engine.gpu.graph_cache import TOKEN_GRAIN

MIXED_GRIDS = ("fine", "pow2")
COMPUTE_BOUND_TOKENS = 256  # from about here a step's time grows with its tokens: the fine grid starts


def mixed_buckets(max_batch: int, budget: int, grid: str = "fine") -> list[tuple[int, int]]:
    """Graphs of chunked-prefill steps: up to the token budget, any batch up to a token per row (the
    running decodes ride in the same step). A step with prompt work pending fills the budget exactly;
    the others pad up to the next captured size (``mixed_tokens``, ``mixed_rows``)."""
    return [(b, t) for t in mixed_tokens(budget, grid) for b in mixed_rows(max_batch, t, grid)]


def mixed_tokens(budget: int, grid: str = "fine") -> list[int]:
    """The token sizes of the mixed-step graphs, ``budget`` the largest (``MIXED_GRIDS``).

    ``pow2``: 16, 32, 64, ...: a step pads up to twice its tokens. ``fine``: the same powers of two up to
    ``COMPUTE_BOUND_TOKENS``, below which a step's time hardly grows with its tokens (reading the weights
    dominates); past it, sizes a multiple of TOKEN_GRAIN apart, the largest one under 5% of the size (at
    least one grain), so a step of t >= COMPUTE_BOUND_TOKENS tokens pads fewer than 0.05 * t + TOKEN_GRAIN
    tokens (5% of t from 320 tokens on)."""
    if grid not in MIXED_GRIDS:
        raise ValueError(f"token grid {grid!r} is not one of {MIXED_GRIDS}")
    top = budget if grid == "pow2" else min(budget, COMPUTE_BOUND_TOKENS)
    sizes, t = set(), TOKEN_GRAIN
    while t < top:
        sizes.add(t)
        t *= 2
    while t < budget:  # fine only: t is COMPUTE_BOUND_TOKENS here
        sizes.add(t)
        t += TOKEN_GRAIN * max(1, t // (20 * TOKEN_GRAIN))
    return sorted(sizes | {budget})


def mixed_rows(max_batch: int, tokens: int, grid: str = "fine") -> list[int]:
    """The batch sizes captured at a mixed-step graph of ``tokens`` tokens (never more rows than tokens).

    Powers of two and ``max_batch``; with ``fine``, past ``COMPUTE_BOUND_TOKENS`` tokens only a quarter of
    ``max_batch`` and ``max_batch``: there a padded row costs a row of the LM head and of sampling, a small
    part of a step that runs the model over hundreds of tokens, and the fine token sizes stay few graphs."""
    if grid == "fine" and tokens > COMPUTE_BOUND_TOKENS:
        rows = {max(1, max_batch // 4), max_batch}
    else:
        rows = {b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch} | {max_batch}
    return sorted(b for b in rows if b <= tokens)
