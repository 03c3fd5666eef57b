"""The mixed-step graph grid (``gpu_engine/gpu/graph_grid.py``) and its lookup table, without a GPU: every step
under the budget finds a graph that holds it; a step of 256 tokens or more pads fewer than 5% of its tokens
plus one grain; the CUDA scheduler's read of the flat table picks the graph ``lookup`` picks; the vectorised
table is the plain search over the graphs; and the grid's sizes and graph counts."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from gpu_engine.gpu.graph_cache import TOKEN_GRAIN, GraphCache
from gpu_engine.gpu.graph_grid import COMPUTE_BOUND_TOKENS, mixed_buckets, mixed_rows, mixed_tokens
from gpu_engine.gpu.serve_gpu import decode_buckets, step_token_limit

SERVING = ((128, 1024), (64, 1024), (256, 2048), (32, 512), (128, 1000))  # (max_batch, token budget)
WIDE = ((512, 1024), (1024, 1024))  # more rows than the persistent scheduler's threads (BLINK_MAX_BATCH 1024)


def mixed_cache(max_batch: int, budget: int, max_tokens: int | None = None) -> GraphCache:
    """A GraphCache of the serving engine's chunked-prefill shapes over a stand-in runner (lookup only)."""
    limits = types.SimpleNamespace(max_batch=max_batch, max_tokens=max_tokens or budget, score_rows=0)
    runner = types.SimpleNamespace(limits=limits, device=torch.device("cpu"))
    shapes = mixed_buckets(max_batch, budget)
    return GraphCache(runner, decode_buckets(max_batch), shapes, device_launch=False,  # type: ignore[arg-type]
                      prefill_variants=True)


def scheduler_pick(table: np.ndarray, grain: int, max_batch: int, filtered: int, n: int, tokens: int) -> int:
    """``pick_graph`` of gpu_engine/csrc/sched_step.cuh for a prefill or mixed step, over the flat table
    (``GraphCache.scheduler_view``'s ``prefill_table`` and ``token_grain``)."""
    cols = table.shape[2]
    b = min(n, max_batch)
    col = min((tokens + grain - 1) // grain, cols - 1)
    return int(table.reshape(-1)[(filtered * (max_batch + 1) + b) * cols + col])


@pytest.mark.parametrize(("max_batch", "budget"), SERVING + WIDE)
def test_every_step_finds_a_graph_that_holds_it(max_batch: int, budget: int) -> None:
    cache = mixed_cache(max_batch, budget)
    batch = np.array([s.batch for s in cache.shapes])
    tokens = np.array([s.tokens for s in cache.shapes])
    steps = np.arange(1, budget + 1)
    cols = -(-steps // TOKEN_GRAIN)
    for f in (0, 1):
        for b in range(1, max_batch + 1):
            t = steps[steps >= b]  # a step carries at least a token per row
            g = cache.prefill_table[f, b, cols[t - 1]]
            assert (batch[g] >= b).all() and (tokens[g] >= t).all(), (f, b)
            assert all(not cache.shapes[i].decode and cache.shapes[i].filtered == bool(f) for i in set(g.tolist()))
            pad, big = tokens[g] - t, t >= COMPUTE_BOUND_TOKENS
            assert (pad[big] < 0.05 * t[big] + TOKEN_GRAIN).all(), (b, t[big][pad[big] >= 0.05 * t[big] + 16])


def test_a_saturated_mixed_step_pads_little() -> None:
    """127 decodes and the last 618 tokens of a prompt under a 1,024-token budget: 745 tokens take a graph of
    fewer than 5% more tokens (powers of two up to the budget, the grid measured against this one, padded the
    step to 1,024), and 128 rows still take a graph of 128."""
    cache = mixed_cache(128, 1024)
    s = cache.shapes[cache.captured(False, 128, 745, filtered=False)]
    assert s.batch == 128 and 0 <= s.tokens - 745 < 0.05 * 745, s


@pytest.mark.parametrize(("max_batch", "budget"), SERVING + WIDE)
def test_the_scheduler_s_read_of_the_table_is_the_lookup(max_batch: int, budget: int) -> None:
    """The persistent scheduler indexes the same table the host looks up (gpu_engine/csrc/sched_step.cuh,
    pick_graph), here over a table wider than the budget (its columns reach the context limit)."""
    cache = mixed_cache(max_batch, budget, max_tokens=2 * budget)
    rng = np.random.default_rng(max_batch + budget)
    for n, tokens in zip(rng.integers(1, max_batch + 1, 400), rng.integers(1, 2 * budget + 1, 400), strict=True):
        tokens = max(int(tokens), int(n))
        for f in (0, 1):
            picked = scheduler_pick(cache.prefill_table, TOKEN_GRAIN, max_batch, f, int(n), tokens)
            assert picked == cache.lookup(False, int(n), tokens, bool(f))[0]


def test_the_table_is_the_cheapest_graph_that_holds_the_step() -> None:
    """The vectorised table against the plain search: the fewest tokens, then the fewest rows, that hold the
    column's tokens and the row's batch; past every graph, the largest."""
    cache = mixed_cache(32, 512, max_tokens=640)
    for f in (0, 1):
        pre = sorted((s.tokens, s.batch, i) for i, s in enumerate(cache.shapes)
                     if not s.decode and s.filtered == bool(f))
        for b in range(33):
            for col in range(cache.prefill_table.shape[2]):
                fits = [i for t, bb, i in pre if bb >= b and t >= col * TOKEN_GRAIN]
                assert cache.prefill_table[f, b, col] == (fits[0] if fits else pre[-1][2]), (f, b, col)


def test_the_grid_and_its_graph_counts() -> None:
    """The grid ends at the budget, keeps a graph at every power of two below 256 tokens and sizes a grain's
    multiple apart past it; the graphs it captures (both variants of every shape, decode graphs included) at
    the serving budgets and at 8,192 tokens (printed: pytest -s)."""
    counts = {}
    for max_batch, budget in (*SERVING, *WIDE, (128, 8192)):
        counts[max_batch, budget] = 2 * (len(decode_buckets(max_batch)) + len(mixed_buckets(max_batch, budget)))
        print(f"max_batch {max_batch} budget {budget}: {counts[max_batch, budget]} graphs")
    assert counts == {(128, 1024): 236, (64, 1024): 228, (256, 2048): 308, (32, 512): 138, (128, 1000): 232,
                      (512, 1024): 250, (1024, 1024): 258, (128, 8192): 416}
    assert len(mixed_buckets(128, 1024)) == 106
    fine = mixed_tokens(1024)
    assert fine[:5] == [16, 32, 64, 128, 256] and fine[-1] == 1024 and all(t % TOKEN_GRAIN == 0 for t in fine)
    assert all(b - a <= max(TOKEN_GRAIN, 0.05 * b) for a, b in zip(fine[4:], fine[5:], strict=False))
    assert mixed_tokens(100) == [16, 32, 64, 100]
    assert mixed_rows(128, 1024) == [32, 128] and mixed_rows(128, 256) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert mixed_rows(128, 16) == [1, 2, 4, 8, 16]
    assert mixed_rows(512, 320) == [128, 320] and mixed_rows(512, 1024) == [128, 512]


def test_decode_sizes_past_256_rows() -> None:
    """The decode graphs up to max_batch: the sizes up to 256 as before, then at most a third apart up to the
    scheduler's 1,024 rows; max_batch itself always."""
    assert decode_buckets(256)[-4:] == [128, 160, 192, 256]
    assert decode_buckets(512)[-4:] == [256, 320, 384, 512]
    wide = decode_buckets(1024)
    assert wide[-7:] == [320, 384, 512, 640, 768, 896, 1024]
    assert all(b <= 1.5 * a for a, b in zip(wide, wide[1:], strict=False) if a >= 8)
    assert all(3 * b <= 4 * a for a, b in zip(wide, wide[1:], strict=False) if a >= 128)
    assert decode_buckets(700)[-3:] == [512, 640, 700]


def test_the_step_token_limit_holds_a_decode_step_of_every_row() -> None:
    """Without chunked prefill and with a context limit under --max-num-seqs (128 tokens, 256 rows) the runner
    still takes a decode step of every row; otherwise the larger of a whole prompt and the chunked budget."""
    assert step_token_limit(128, None, 256) == 256
    assert step_token_limit(128, 1024, 64) == 1024
    assert step_token_limit(4096, 1024, 64) == 4096
