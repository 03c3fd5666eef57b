"""Build a Triton kernel's TTIR for sm_90 without a GPU (tests/test_kernels_ttir.py runs this in a process of its
own: under TRITON_INTERPRET=1 kernels are interpreter objects, which the compiler does not take)."""

from __future__ import annotations

import json
import sys


def ttir(fn, signature: dict[str, str], constexprs: dict[str, object]) -> str:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({"num_warps": 4})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    module = ASTSource(fn, sig, constexprs).make_ir(target, options, backend.get_codegen_implementation(options),
                                                    backend.get_module_map(), ctx)
    return str(module)


def _compiled(fn, signature: dict[str, str], constexprs: dict[str, object], options: dict | None = None,
              divisible: tuple[str, ...] = ()):
    """The kernel compiled for sm_90 down to its cubin (ptxas bundled with Triton; no GPU). `divisible`:
    arguments taken as multiples of 16, as a launch specializes them (the loads' pipelining depends on it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def shared_bytes(fn, signature: dict[str, str], constexprs: dict[str, object], options: dict,
                 divisible: tuple[str, ...] = ()) -> int:
    """The shared memory a block of the compiled kernel takes (`_compiled`)."""
    return int(_compiled(fn, signature, constexprs, options, divisible).metadata.shared)


def ptx_counts(fn, signature: dict[str, str], constexprs: dict[str, object], options: dict, patterns: list[str],
               divisible: tuple[str, ...] = ()) -> dict[str, int]:
    """The compiled kernel's PTX (`_compiled`, `divisible` as a launch specializes its arguments): its instructions
    (lines ending in `;`, comments cut, that are no directive), and how many have an opcode starting with each of
    `patterns` (e.g. "cvt.bf16.f16"), a guard (`@%p1`, `@!%p1`) set aside."""
    import re

    ptx = _compiled(fn, signature, constexprs, options, divisible).asm["ptx"]
    ops = [line.split("//", 1)[0].strip() for line in ptx.splitlines()]
    ops = [op for op in ops if op.endswith(";") and not op.startswith(".")]
    opcodes = [m.group(1) for op in ops if (m := re.match(r"(?:@!?%\w+\s+)?([\w.]+)", op))]
    return {"instructions": len(ops), **{p: sum(o.startswith(p) for o in opcodes) for p in patterns}}


def main() -> None:
    """argv: module, kernel name, then a JSON object {"signature": {...}, "constexprs": {...}}; with "options"
    (and "divisible") in it, the shared memory of the compiled kernel instead of whether its TTIR builds; with "ptx"
    (a list of opcode prefixes) beside "options", `ptx_counts` as JSON."""
    import importlib

    module, name, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    fn = getattr(importlib.import_module(module), name)
    if "ptx" in spec:
        print(json.dumps(ptx_counts(fn, spec["signature"], spec["constexprs"], spec["options"], spec["ptx"],
                                    tuple(spec.get("divisible", ())))))
        return
    if "options" in spec:
        divisible = tuple(spec.get("divisible", ()))
        print(shared_bytes(fn, spec["signature"], spec["constexprs"], spec["options"], divisible))
        return
    text = ttir(fn, spec["signature"], spec["constexprs"])
    print("tt.func" in text)


if __name__ == "__main__":
    main()
