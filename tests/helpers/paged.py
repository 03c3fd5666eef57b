"""A paged K/V cache for the attention kernels' tests: random blocks, each sequence's in a random order."""

from __future__ import annotations

import torch


def paged_cache(lens: list[int], device: str | torch.device, hkv: int = 2, d: int = 16, bs: int = 4,
                nblocks: int = 40, dtype: torch.dtype = torch.float32, seed: int = 0):
    """(K cache, V cache, block tables, context lengths): `nblocks` random blocks of `bs` tokens, sequence b's
    cdiv(lens[b], bs) blocks drawn without repeats, the tables one block wider than the longest (-1 past each
    sequence's blocks)."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(nblocks, bs, hkv, d, generator=g).to(device, dtype)
    vc = torch.randn(nblocks, bs, hkv, d, generator=g).to(device, dtype)
    width = max(1, max(-(-n // bs) for n in lens) + 1)
    perm = torch.randperm(nblocks, generator=g).tolist()
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        nb = -(-n // bs)
        tables[b, :nb] = torch.tensor(perm[used: used + nb], dtype=torch.int32)
        used += nb
    return kc, vc, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
