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


def ptx_pdl(fn, signature: dict[str, str], constexprs: dict[str, object]) -> dict[str, object]:
    """The kernel's programmatic-dependent-launch instructions in its sm_90 PTX (`_compiled`): how many
    `griddepcontrol.wait` and `griddepcontrol.launch_dependents`, and the line of each first one and of the
    first global-memory access (a load, store, atomic or async copy, predicated or not; -1 where there is none)."""
    import re

    ptx = _compiled(fn, signature, constexprs).asm["ptx"]
    lines = ptx.splitlines()
    memory = re.compile(r"^\s*(@!?%p\d+\s+)?(ld|st|atom|red)\.global|^\s*(@!?%p\d+\s+)?cp\.async")

    def first(match) -> int:
        return next((i for i, line in enumerate(lines) if match(line)), -1)

    return {"wait": ptx.count("griddepcontrol.wait"),
            "launch_dependents": ptx.count("griddepcontrol.launch_dependents"),
            "first_wait": first(lambda line: "griddepcontrol.wait" in line),
            "first_launch_dependents": first(lambda line: "griddepcontrol.launch_dependents" in line),
            "first_memory": first(memory.match)}


def main() -> None:
    """argv: module, kernel name, then a JSON object {"signature": {...}, "constexprs": {...}}; with "options"
    (and "divisible") in it, the shared memory of the compiled kernel instead of whether its TTIR builds; with
    "ptx": true, its programmatic-dependent-launch instructions (`ptx_pdl`), as JSON."""
    import importlib

    module, name, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    fn = getattr(importlib.import_module(module), name)
    if spec.get("ptx"):
        print(json.dumps(ptx_pdl(fn, spec["signature"], spec["constexprs"])))
        return
    if "options" in spec:
        divisible = tuple(spec.get("divisible", ()))
        print(shared_bytes(fn, spec["signature"], spec["constexprs"], spec["options"], divisible))
        return
    text = ttir(fn, spec["signature"], spec["constexprs"])
    print("tt.func" in text)


if __name__ == "__main__":
    main()
