"""The scheduler's host structs are declared once (schema/sched_structs.py): the committed C header
and ctypes mirror are what the spec generates, and the C compiler lays out every field of the real
header exactly where the mirror puts it (a swapped pair of same-typed fields, which a size check
lets through, fails here)."""

from __future__ import annotations

import ctypes as C
import shutil
import subprocess
from pathlib import Path

import pytest

from gpu_engine.gpu import sched_structs as mirror
from schema import sched_structs as spec

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "gpu_engine" / "csrc"
CC = shutil.which("cc") or shutil.which("gcc")
STRUCTS = ((mirror.SchedConfig, "blink_sched_config"), (mirror.SchedStats, "blink_sched_stats"))

Layout = dict[str, tuple[int, int]]  # "struct.field" (or "struct" for its size): (offset, size)


def c_layout(tmp: Path, structs: tuple[tuple[type[C.Structure], str], ...]) -> Layout:
    """Offset and size of every field the mirrors name, as the C compiler lays out sched.h."""
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "sched.h"', "int main(void) {"]
    for py, c in structs:
        for f in py._fields_:
            lines.append(f'  printf("{c}.{f[0]} %zu %zu\\n", offsetof({c}, {f[0]}), sizeof((({c} *)0)->{f[0]}));')
        lines.append(f'  printf("{c} 0 %zu\\n", sizeof({c}));')
    lines += ["  return 0;", "}", ""]
    src, exe = tmp / "layout.c", tmp / "layout"
    src.write_text("\n".join(lines))
    assert CC is not None
    subprocess.run([CC, "-std=c11", "-Wall", "-Werror", f"-I{CSRC}", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {name: (int(off), int(size)) for name, off, size in (line.split() for line in out.splitlines())}


def py_layout(structs: tuple[tuple[type[C.Structure], str], ...]) -> Layout:
    out: Layout = {}
    for py, c in structs:
        for f in py._fields_:
            d = getattr(py, f[0])
            out[f"{c}.{f[0]}"] = (d.offset, d.size)
        out[c] = (0, C.sizeof(py))
    return out


def mismatches(tmp: Path, structs: tuple[tuple[type[C.Structure], str], ...]) -> list[str]:
    want, have = c_layout(tmp, structs), py_layout(structs)
    return [f"{k}: C {want[k]} vs ctypes {have[k]} (offset, size)" for k in want if want[k] != have[k]]


def test_generated_header_and_mirror_are_current() -> None:
    assert spec.check() == [], "run `python -m schema.sched_structs` (or `blink gen-schema`) and commit the result"


@pytest.mark.skipif(CC is None, reason="needs a C compiler (cc)")
def test_every_field_sits_where_the_mirror_puts_it(tmp_path: Path) -> None:
    assert mismatches(tmp_path, STRUCTS) == []


@pytest.mark.skipif(CC is None, reason="needs a C compiler (cc)")
def test_two_swapped_fields_of_one_type_are_caught(tmp_path: Path) -> None:
    fields = list(mirror.SchedConfig._fields_)
    a, b = (next(k for k, f in enumerate(fields) if f[0] == n) for n in ("num_blocks", "block_size"))
    fields[a], fields[b] = fields[b], fields[a]
    swapped = type("Swapped", (C.Structure,), {"_fields_": fields})
    assert C.sizeof(swapped) == C.sizeof(mirror.SchedConfig), "the size check alone would pass"
    bad = mismatches(tmp_path, ((swapped, "blink_sched_config"),))
    assert sorted(m.split(":")[0] for m in bad) == ["blink_sched_config.block_size", "blink_sched_config.num_blocks"]


def test_the_constants_reach_both_sides() -> None:
    header = (CSRC / "sched_structs.h").read_text()
    for k in spec.CONSTANTS:
        assert f"#define {k.c_name} {k.value}\n" in header
        assert getattr(mirror, k.py_name) == k.value
    assert mirror.SchedConfig.eos_ids.size == 4 * mirror.MAX_EOS
    assert mirror.SchedStats.scan_ns.size == 4 * mirror.SAMPLES


def test_a_field_type_outside_the_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of"):
        spec.Decl("size_t", "bytes")


def test_step_times_read_the_samples_and_the_gap_counters() -> None:
    """The "scheduler exited" line's step times: percentiles of the launch -> completion samples, and the mean gap
    between back-to-back steps (None before any)."""
    from gpu_engine.gpu.persistent import SchedStats

    st = SchedStats()
    assert st.step_times() == {"step_ms_p50": None, "step_ms_p99": None, "gap_us": None}
    for k, ms in enumerate((10, 20, 30)):
        st.step_ns[k] = ms * 1_000_000
    st.n_step_samples = 3
    st.gap_ns, st.gap_steps = 3_000_000, 2
    assert st.step_times() == {"step_ms_p50": 20.0, "step_ms_p99": 29.8, "gap_us": 1500.0}
    assert st.counters()["gap_ns"] == 3_000_000 and st.counters()["gap_steps"] == 2
