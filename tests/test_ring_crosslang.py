"""A C++ program writes slots into a shared-memory ring and Python reads every field, and back."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from shared import ring_layout as L
from shared.ring import RingGeometry, attach_shm_ring, create_shm_ring
from tests.test_schema import ROOT, flatbuffers_include

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
N = 64


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("cpp") / "ring_peer"
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{flatbuffers_include()}",
                    f"-I{ROOT / 'schema' / 'cpp'}", str(ROOT / "tests" / "cpp" / "ring_peer.cpp"),
                    "-o", str(exe)], check=True)
    return exe


def test_cpp_writes_python_reads(peer: Path, ring_name: str) -> None:
    ring = create_shm_ring(ring_name, RingGeometry(N, 16, 8, 2))
    out = subprocess.run([str(peer), "write", ring_name], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    view = attach_shm_ring(ring_name)
    s = view.read_slots()
    i = np.arange(N, dtype=np.uint64)
    assert (s["state"] == L.SlotState.PREFILL_PENDING).all() and (s["seq"] == i + 1).all()
    assert (s["request_id"] == 1000000 + i).all() and (s["prompt_len"] == 1 + i % 7).all()
    assert (s["max_new_tokens"] == 10 + i).all() and (s["generated"] == 3 * i).all()
    assert (s["finish_reason"] == i % 6).all() and (s["error_code"] == i % 5).all()
    assert (s["cancel"] == (i & 1)).all()
    for field, k in (("submit_ns", 111), ("admit_ns", 222), ("first_token_ns", 333), ("last_token_ns", 444)):
        assert (s[field] == k * i).all(), field
    sp = s["sampling"]
    assert np.array_equal(sp["temperature"], 0.5 * i.astype(np.float32))
    assert (sp["top_p"] == 0.25).all() and (sp["min_p"] == 0.125).all()
    assert (sp["top_k"] == i.astype(np.int64) - 3).all()
    assert (sp["seed"] == 0xABCDEF0000000000 + i).all() and (sp["flags"] == i % 8).all()
    assert (sp["num_top_logprobs"] == i % 21).all() and (sp["num_stop_ids"] == i % 9).all()
    assert (sp["stop_ids"] == (i[:, None] * 10 + np.arange(8)).astype(np.int32)).all()
    for k in range(N):
        assert list(view.prompt_tokens[k, : 1 + k % 7]) == [k * 100 + t for t in range(1 + k % 7)]
    view.close()
    ring.transport.unlink()
    ring.close()


def test_python_writes_cpp_reads(peer: Path, ring_name: str) -> None:
    ring = create_shm_ring(ring_name, RingGeometry(N, 16, 8, 2))
    s = np.zeros(N, L.SLOT_DTYPE)
    i = np.arange(N, dtype=np.uint64)
    s["state"], s["seq"] = L.SlotState.DECODE_COMPLETED, 7 * i
    s["request_id"], s["prompt_len"], s["max_new_tokens"] = 5000000 + i, 2 + i % 5, 20 + i
    s["generated"], s["finish_reason"] = i, L.FinishReason.LENGTH
    s["cancel"], s["last_token_ns"] = (i % 3 == 0), 999 * i
    s["sampling"]["temperature"], s["sampling"]["top_k"] = 0.75, i
    s["sampling"]["seed"], s["sampling"]["num_stop_ids"] = 0x1234567800000000 + i, 2
    s["sampling"]["stop_ids"][:, 1] = i + 1
    ring.slots[:] = s
    for k in range(N):
        ring.prompt_tokens[k, : 2 + k % 5] = k + np.arange(2 + k % 5)
    out = subprocess.run([str(peer), "read", ring_name], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"read {N} slots, 0 mismatches" in out.stdout
    ring.slots[5]["sampling"]["top_k"] = 99  # one wrong field must be caught
    out = subprocess.run([str(peer), "read", ring_name], capture_output=True, text=True)
    assert out.returncode == 1 and "slot 5: field sampling.top_k differs" in out.stderr
    ring.transport.unlink()
    ring.close()
