"""Import layering: the house rule between the product packages (the engine and the frontend meet only in the
ring, both standing on ``shared/``), no import cycles, and the KV cache stands below the models."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shared", "gpu_engine", "blink")
ENGINE = ("gpu_engine",)
FRONTEND = ("dpu_gateway", "dpu_tokenizer")


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


def imports_by_line(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    """(line, module) for every import of a file, at the top or inside a function; a relative import resolved
    against the package of ``module`` (the file's own name by default): ``from . import x`` in ``a.b`` is ``a.x``."""
    parts = (module or module_name(path)).split(".")
    package = parts if path.name == "__init__.py" else parts[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, *([node.module] if node.module else [])])
            found += [(node.lineno, name)] + [(node.lineno, f"{name}.{a.name}".lstrip(".")) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def edges_into(importers: tuple[str, ...], imported_pkgs: tuple[str, ...]) -> list[str]:
    """``file:line imports module`` wherever a file of ``importers`` imports a module of ``imported_pkgs``."""
    hits = []
    for pkg in importers:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            hits += [f"{path.relative_to(ROOT)}:{line} imports {mod}" for line, mod in imports_by_line(path)
                     if mod.split(".")[0] in imported_pkgs]
    return hits


def test_the_engine_and_the_frontend_never_import_each_other() -> None:
    """The house rule (docs/DESIGN.md): no edge between ``gpu_engine`` and the ``dpu_*`` packages, either way."""
    edges = edges_into(ENGINE, FRONTEND) + edges_into(FRONTEND, ENGINE)
    assert not edges, edges


def test_shared_imports_no_other_product_package() -> None:
    """``shared/`` is the ground floor both sides stand on: it imports neither of them, nor the ``blink`` command."""
    edges = edges_into(("shared",), (*ENGINE, *FRONTEND, "blink"))
    assert not edges, edges


def test_the_rule_sees_imports_inside_functions_and_relative_ones(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import dpu_gateway.app\n\n\nfrom . import runner\nfrom ..kv_cache import KVCache\n")
    found = {name for _, name in imports_by_line(probe, "gpu_engine.gpu.probe")}
    assert {"dpu_gateway.app", "gpu_engine.gpu.runner", "gpu_engine.kv_cache.KVCache"} <= found, found


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
