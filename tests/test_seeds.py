"""One seed-derivation constant: the gateway's choice seeds, the engine's request seeds and the CUDA scheduler's."""

from __future__ import annotations

import re
from pathlib import Path

from dpu_gateway.params import Plan
from gpu_engine.sampling import request_seed
from shared import messages as m
from shared.seeds import SEED_STEP

CSRC = Path(__file__).resolve().parent.parent / "gpu_engine" / "csrc"


def test_cuda_claim_derives_request_seeds_with_the_python_constant() -> None:
    """The scheduler's claim (sched_claim.cuh) multiplies the request id by the same literal."""
    found = re.findall(r"request_id\s*\*\s*(0x[0-9A-Fa-f]+)ull", (CSRC / "sched_claim.cuh").read_text())
    assert found, "sched_claim.cuh no longer derives a seed from request_id"
    assert [int(v, 16) for v in found] == [SEED_STEP] * len(found)


def test_request_seed_is_the_id_times_the_step_in_63_bits() -> None:
    for rid in (0, 1, 77, 2**40 + 3, 2**64 - 1):
        assert request_seed(rid) == (rid * SEED_STEP) % 2**63


def test_seeded_choices_step_by_the_constant_and_wrap_at_64_bits() -> None:
    plan = Plan(sampling=m.Sampling(8, seed=2**64 - 2), stop=[], n=3)
    assert [c.seed for c in plan.choices()] == [(2**64 - 2 + i * SEED_STEP) % 2**64 for i in range(3)]
    unseeded = Plan(sampling=m.Sampling(8), stop=[], n=2)
    assert [c.seed for c in unseeded.choices()] == [None, None]
