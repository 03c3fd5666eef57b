"""The GGUF metadata reader (``shared.gguf_meta``) against the ``gguf`` package's reader, and its errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from gpu_engine.models.loader import default_model_path
from shared.gguf_meta import GgufFormatError, read_meta


def same_as_gguf_reader(path: Path) -> None:
    """Every field and tensor entry equal to what ``gguf.GGUFReader`` reads from the same file."""
    ours, theirs = read_meta(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert ours.version == theirs.fields["GGUF.version"].contents()
    assert [(t.name, t.shape, t.ggml_type, t.offset) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset)) for t in theirs.tensors]


def test_every_value_type_and_tensor(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "ünï"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.25, -1.5])
    w.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("b", np.ones((4, 8), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    same_as_gguf_reader(path)
    meta = read_meta(path)
    assert meta.fields["t.str"] == "héllo ✓" and meta.fields["t.strs"] == ["a", "", "ünï"]
    a = next(t for t in meta.tensors if t.name == "a")
    data = np.fromfile(path, dtype=np.float32, count=6, offset=a.offset)
    assert data.tolist() == list(range(6))  # the offset points at the tensor's bytes


def test_the_embedded_model_file() -> None:
    try:
        path = default_model_path()
    except Exception as exc:  # noqa: BLE001 - the embedded model package is optional
        pytest.skip(f"embedded model not installed: {exc}")
    same_as_gguf_reader(Path(path))
    assert len(read_meta(path).fields["tokenizer.ggml.tokens"]) == 49152


@pytest.mark.parametrize(("content", "message"), [
    (b"", "cannot mmap an empty file"),
    (b"GGML" + bytes(20), "bad magic"),
    (b"GGUF" + (9).to_bytes(4, "little") + bytes(16), "version 9 is not supported"),
    (b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
     + (200).to_bytes(8, "little") + b"k", "runs past the end"),
    (b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
     + (1).to_bytes(8, "little") + b"k" + (99).to_bytes(4, "little"), "unknown value type 99"),
    (b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little"), "cut short"),
])
def test_bad_files_are_refused_with_the_reason(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GgufFormatError, match=message):
        read_meta(path)
