"""The shapes of the chunked-prefill (mixed-step) graphs: which (rows, tokens) the GPU backends capture.

A mixed step carries the running decodes (a token each) and prompt chunks, up to the token budget; it runs
the cheapest captured graph that holds it (``GraphCache.prefill_table``), computing the graph's tokens, so
the tokens between the step's and the graph's are padding (``RingHeader.padded_tokens`` counts them). The
grid keeps powers of two up to ``COMPUTE_BOUND_TOKENS`` and sizes under 5% apart past it. Powers of two up to
the budget, the other grid once measured beside this one, captured half the graphs but padded 10.5% of the
step tokens against 3.1% here, and served slower on an H100 (BENCHMARKS.md, "Padding of mixed steps").
"""

from __future__ import annotations

from gpu_engine.gpu.graph_cache import TOKEN_GRAIN

COMPUTE_BOUND_TOKENS = 256  # from about here a step's time grows with its tokens: the sizes get closer


def mixed_buckets(max_batch: int, budget: int) -> list[tuple[int, int]]:
    """Graphs of chunked-prefill steps: up to the token budget, any batch up to a token per row (the
    running decodes ride in the same step). A step with prompt work pending fills the budget exactly;
    the others pad up to the next captured size (``mixed_tokens``, ``mixed_rows``)."""
    return [(b, t) for t in mixed_tokens(budget) for b in mixed_rows(max_batch, t)]


def mixed_tokens(budget: int) -> list[int]:
    """The token sizes of the mixed-step graphs, ``budget`` the largest.

    Powers of two from TOKEN_GRAIN up to ``COMPUTE_BOUND_TOKENS``, below which a step's time hardly grows
    with its tokens (reading the weights dominates); past it, sizes a multiple of TOKEN_GRAIN apart, the
    largest one under 5% of the size (at least one grain), so a step of t >= COMPUTE_BOUND_TOKENS tokens
    pads fewer than 0.05 * t + TOKEN_GRAIN tokens (5% of t from 320 tokens on)."""
    sizes, t = set(), TOKEN_GRAIN
    while t < min(budget, COMPUTE_BOUND_TOKENS):
        sizes.add(t)
        t *= 2
    while t < budget:  # t is COMPUTE_BOUND_TOKENS here
        sizes.add(t)
        t += TOKEN_GRAIN * max(1, t // (20 * TOKEN_GRAIN))
    return sorted(sizes | {budget})


def mixed_rows(max_batch: int, tokens: int) -> list[int]:
    """The batch sizes captured at a mixed-step graph of ``tokens`` tokens (never more rows than tokens).

    Powers of two and ``max_batch``; past ``COMPUTE_BOUND_TOKENS`` tokens only a quarter of ``max_batch`` and
    as many rows as the graph has tokens, up to ``max_batch`` (``max_batch`` itself up to 256 rows): there a
    padded row costs a row of the LM head and of sampling, a small part of a step that runs the model over
    hundreds of tokens, and the close token sizes stay few graphs. With more rows than 256, a step of n rows
    (a token each at least) then finds a graph at the first token size that holds its tokens, not only at
    ``max_batch`` tokens."""
    if tokens > COMPUTE_BOUND_TOKENS:
        rows = {max(1, max_batch // 4), min(tokens, max_batch)}
    else:
        rows = {b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch} | {max_batch}
    return sorted(b for b in rows if b <= tokens)
