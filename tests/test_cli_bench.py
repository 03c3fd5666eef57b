"""``blink bench``: lists the benchmarks, runs one from the checkout, never imports bench at start-up."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from blink import cli

ROOT = Path(__file__).resolve().parent.parent


def test_bench_alone_lists_every_tool(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench"]) == 0
    out = capsys.readouterr().out
    for name, (_, what) in cli.BENCH_TOOLS.items():
        assert f"  {name} " in out and what in out
    assert set(cli.BENCH_TOOLS) == {"serve", "interfere", "soak", "study", "roofline", "micro", "fig3",
                                    "tokenizer", "conn-storm", "cpu"}


@pytest.mark.parametrize("name", sorted(cli.BENCH_TOOLS))
def test_every_tool_is_a_bench_module_with_a_main(name: str) -> None:
    module = ROOT / "bench" / f"{cli.BENCH_TOOLS[name][0]}.py"
    tree = ast.parse(module.read_text())
    assert any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body), module


def test_a_tool_runs_from_the_checkout(tmp_path: Path) -> None:
    # Run from elsewhere: bench/ is found beside the CLI's own package, not on the working directory.
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from blink import cli; "
            "sys.exit(cli.main(['bench', 'interfere', '--help']))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout and "--cores" in run.stdout


def test_the_cli_does_not_import_bench() -> None:
    code = ("import sys; from blink import cli; assert cli.main(['bench']) == 0; "
            "bad = [m for m in sys.modules if m == 'bench' or m.startswith(('bench.', 'harness'))]; "
            "print(cli.__file__, bad, file=sys.stderr); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr.startswith(str(ROOT / "blink"))  # this checkout's CLI


def test_without_a_checkout_it_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "CHECKOUT", tmp_path)  # an installed package: no bench/ beside it
    assert cli.main(["bench", "soak", "--help"]) == 2
    err = capsys.readouterr().err
    assert "run from a source checkout" in err and "pip install -e" in err and "python -m bench.soak" in err


def test_an_unknown_tool_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "nope"]) == 2
    assert "no benchmark 'nope'" in capsys.readouterr().err
