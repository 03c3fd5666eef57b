"""Seed derivation, one constant for the gateway and the engine.

``SEED_STEP`` (2**64 over the golden ratio, odd) spreads consecutive integers over the 64-bit
range. The engine gives a request without a seed ``request_id * SEED_STEP`` (kept to 63 bits); the
gateway gives choice i of a seeded request with n > 1 the seed ``seed + i * SEED_STEP`` (mod 2**64).
The CUDA scheduler derives the first at claim with its own literal (``csrc/sched_claim.cuh``);
tests/test_seeds.py holds the two equal.
"""

from __future__ import annotations

SEED_STEP = 0x9E3779B97F4A7C15
