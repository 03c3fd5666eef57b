"""The scheduler's CUDA sources are real compilation units: each header compiles on its own (and
twice in a row, behind its include guard), no function grows past 60 lines, and finish reasons
and slot states are the ring schema's, not copies of them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "gpu_engine" / "csrc"
HEADERS = sorted(p.name for p in CSRC.iterdir() if p.suffix in (".cuh", ".h"))
SOURCES = sorted(p for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".h"))
NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)
MAX_LINES = 60

# A definition starts at column 0 with a parenthesis and no semicolon before its opening brace; its
# body ends at the first "}" alone at column 0 (clang-format's layout: namespaces are not indented).
NOT_A_FUNCTION = re.compile(r"//|#|\}|(struct|class|namespace|extern|enum|union|typedef|template|static_assert)\b")


def function_lengths(path: Path) -> list[tuple[int, int, str]]:
    """(first line, length in lines, signature) of every function defined in a source file."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        head = lines[i]
        if head[:1].strip() and "(" in head and not NOT_A_FUNCTION.match(head) and not head.rstrip().endswith(";"):
            j = i
            while j < len(lines) and not lines[j].rstrip().endswith(("{", ";", "}")):
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith("{"):
                end = next(k for k in range(j, len(lines)) if lines[k] == "}")
                found.append((i + 1, end - i + 1, head.strip()))
                i = end
        i += 1
    return found


def test_function_lengths_are_measured() -> None:
    found = {sig.split("(")[0].split()[-1]: n for _, n, sig in function_lengths(CSRC / "sched_claim.cuh")}
    assert {"claim_new", "claim_pending", "scan_begin", "order_claims", "admit_claims"} <= found.keys()
    assert all(n > 3 for n in found.values())


def test_no_function_is_longer_than_60_lines() -> None:
    long = [f"{p.name}:{line} {sig} ({n} lines)" for p in SOURCES for line, n, sig in function_lengths(p)
            if n > MAX_LINES]
    assert long == [], "split these functions"


def test_finish_reasons_and_slot_states_are_the_schemas() -> None:
    copies = re.compile(r"enum\s+\w*(Finish|SlotState|State)\b"
                        r"|\bk(None|Eos|Length|StopId|Cancelled|Error|Pending|Completed)\b")
    found = [f"{p.name}: {m.group(0)}" for p in SOURCES for m in copies.finditer(p.read_text())]
    assert found == [], "use BLINK_FINISH_REASON_* and BLINK_SLOT_STATE_* from schema/cpp/blink_ring.h"


def compile_alone(header: str, tmp: Path) -> str:
    """nvcc's complaints about a unit that includes ``header`` twice and nothing else ("" if none)."""
    unit = tmp / f"{header}.cu"
    unit.write_text(f'#include "{header}"\n#include "{header}"\n')
    assert NVCC is not None
    cmd = [NVCC, "-std=c++17", "-arch=sm_90a", "-rdc=true", "-fdevice-syntax-only", "-Werror=all-warnings",
           f"-I{CSRC}", f"-I{ROOT / 'schema' / 'cpp'}", "-c", str(unit), "-o", str(tmp / f"{header}.o")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    return "" if res.returncode == 0 else f"{header}:\n{res.stderr[-2000:]}"


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (CUDA toolkit) to compile the headers")
def test_every_header_compiles_alone(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=max(1, min(len(HEADERS), os.cpu_count() or 1))) as pool:
        errors = [e for e in pool.map(lambda h: compile_alone(h, tmp_path), HEADERS) if e]
    assert errors == [], "\n".join(errors)
