"""Experiment: decode attention with fewer split programs, each striding over a row's splits.

The runner's decode attention (`gpu_engine.kernels.attention.decode_attention`, split form) launches a program per
(row, KV head, split) of the block table's width: 8,208 tokens make 33 splits of 256, so a served 128-row step
(mean context about 1,200 tokens, 5 splits) starts about 33,800 programs of which about 5,300 have tokens. Here a
program per (row, KV head, lane) of `lanes` lanes computes splits lane, lane + lanes, ... of its row, each split's
sums exactly as the runner's (`_split_sums`) and folded by the same `_fold_kernel`, so the output has the same bits;
the programs are min(lanes, 33) / 33 as many (64 lanes: the runner's grid, its query read only by programs with
tokens). Timed against the runner's form on the kernel benchmark's shapes,
equal contexts and served ones, with a bit check:

    python -m bench.attn_stride --out OUT/attn_stride.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.kernels import _nbytes, _paged_cache, copy_gbps, entry, graph_ms, served_contexts
from gpu_engine.kernels.attention import (
    LOG2E,
    _fold_kernel,
    _prec,
    _split_sums,
    _store_partial,
    decode_attention,
    decode_partials,
)

LANES = (2, 4, 8, 64)  # 64: as many as the splits (33 here), a program each, the query read only with tokens


@triton.jit
def _stride_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, po_ptr, pm_ptr, pl_ptr,
                   sq_b, sq_h, sbt_b, scale_log2, v_scale, NSPLIT,
                   HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, PART: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr,
                   PREC: tl.constexpr):
    b, kvh, lane = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_ctx = tl.load(ctx_ptr + b)
    n_active = tl.minimum(tl.cdiv(n_ctx, PART), NSPLIT)
    if lane < n_active:  # the query is read only by a program with a split to compute
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kvh * G + g
        gmask = g < G
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gmask[:, None] & (d[None, :] < D),
                    other=0.0)
        bt_row = bt_ptr + b.to(tl.int64) * sbt_b
        for s in range(lane, n_active, LANES):
            acc, m, lsum = _split_sums(q, kc_ptr, vc_ptr, bt_row, s, n_ctx, kvh, d, scale_log2, v_scale, HKV, D, BS,
                                       BLOCK_G, BLOCK_D, PART, BLOCK_N, PREC)
            _store_partial(po_ptr, pm_ptr, pl_ptr, b, heads, s, d, gmask, acc, m, lsum, NSPLIT, HKV, G, BLOCK_D)


def stride_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float, out: torch.Tensor,
                     lanes: int, partition_size: int = 256, block_n: int = 128) -> torch.Tensor:
    """The runner's split-form decode attention (bf16 cache) with `lanes` split programs a (row, KV head)."""
    B = q.shape[0]
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    nsplit, (po, pm, pl), consts = decode_partials(q, hkv, block_tables.shape[1] * bs, partition_size)
    _stride_kernel[(B, hkv, min(lanes, nsplit))](
        q, k_cache, v_cache, block_tables, context_lens, po, pm, pl, q.stride(0), q.stride(1), block_tables.stride(0),
        scale * LOG2E, 1.0, nsplit, BS=bs, BLOCK_N=block_n, LANES=lanes, PREC=_prec(q.dtype), num_warps=4, **consts)
    _fold_kernel[(B, hkv)](po, pm, pl, context_lens, out, out.stride(0), out.stride(1), nsplit, num_warps=4, **consts)
    return out


def shape_rows(lens: list[int], gbps: float, width: int = 513) -> list[dict]:
    """The runner's form and each lane count on one batch of contexts (8 KV heads, Llama-3-8B's)."""
    B, hkv = len(lens), 8
    kc, vc, tables = _paged_cache([n // 16 + 1 for n in lens], hkv, width)
    ctx = torch.tensor(lens, device="cuda", dtype=torch.int32)
    q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)
    ref, out = torch.empty_like(q), torch.empty_like(q)
    decode_attention(q, kc, vc, tables, ctx, 128 ** -0.5, out=ref)
    nbytes = 2 * sum(lens) * hkv * 128 * 2 + 2 * _nbytes(q)
    equal = len(set(lens)) == 1
    base = {"batch": B, "context": lens[0] if equal else -1, "context_mean": sum(lens) / B, "context_max": max(lens),
            "kv_heads": hkv}
    ms = graph_ms(lambda: decode_attention(q, kc, vc, tables, ctx, 128 ** -0.5, out=out))
    found = [{"case": "runner", **base, **entry(ms, nbytes, gbps)}]
    for lanes in LANES:
        out.zero_()
        stride_attention(q, kc, vc, tables, ctx, 128 ** -0.5, out, lanes)
        same = bool(torch.equal(out, ref))
        ms = graph_ms(lambda lanes=lanes: stride_attention(q, kc, vc, tables, ctx, 128 ** -0.5, out, lanes))
        found.append({"case": f"lanes{lanes}", **base, "same_bits": same, **entry(ms, nbytes, gbps)})
    print("\n".join(f"{r['case']:>8} B={r['batch']:>3} ctx={r['context']:>5} mean={r['context_mean']:7.0f} "
                    f"{r['ms'] * 1e3:8.1f} us {r['gbps'] / gbps:.2f} of copy {r.get('same_bits', '')}" for r in found),
          flush=True)
    return found


def rows(gbps: float) -> list[dict]:
    shapes = [[ctx] * B for ctx in (512, 2048) for B in (64, 128)] + [served_contexts(B) for B in (32, 64, 128, 256)]
    return [r for lens in shapes for r in shape_rows(lens, gbps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    gbps = copy_gbps()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"gpu": torch.cuda.get_device_name(), "host": platform.node(), "commit": commit or None,
           "copy_gbps": gbps, "rows": rows(gbps)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
