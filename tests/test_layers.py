"""Import layering of the engine: no import cycles, and the KV cache stands below the models."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shared", "gpu_engine", "blink")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (``from a import b``: a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "generated" not in p.parts}
    return {name: {m for m in imported(path) if m in files and m != name} for name, path in files.items()}


def cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = [c for m in sorted(graph) if (c := cycle_from(graph, m))]
    assert not cycles, f"import cycles: {cycles[:3]}"


def test_serve_and_the_gpu_backends_share_only_the_backend_module() -> None:
    graph = import_graph()
    assert "gpu_engine.serve" not in graph["gpu_engine.gpu.serve_gpu"]
    assert "gpu_engine.backend" in graph["gpu_engine.gpu.serve_gpu"] & graph["gpu_engine.serve"]


def test_the_kv_cache_does_not_import_the_models() -> None:
    """The block allocator stands on its prefix cache only, and that on nothing of the engine."""
    deps = imported(ROOT / "gpu_engine" / "kv_cache.py")
    leaf = {"gpu_engine.prefix_cache", "gpu_engine.prefix_cache.PrefixCache"}
    assert not [m for m in deps if m.startswith("gpu_engine.") and m not in leaf], deps
    cache_deps = imported(ROOT / "gpu_engine" / "prefix_cache.py")
    assert not [m for m in cache_deps if m.startswith("gpu_engine.")], cache_deps
