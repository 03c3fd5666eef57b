"""Long independent checks (mypy) started in the background when the test session starts; the test that
owns one only collects its result, so the check's minutes overlap the rest of the suite.

A check starts only when its test was selected. Under pytest-xdist every worker reaches ``start``; a lock
file in the run's shared temporary folder lets the first one start the process and the others skip it.
The process writes its output and then its exit status (atomically) into that folder, where whichever
worker runs the test finds them. The worker that started a check waits for it before it exits.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The child: run the command, its output into OUT, then its exit status into RC (written whole, then renamed).
_RUNNER = ("import os, subprocess, sys\n"
           "out, rc, *cmd = sys.argv[1:]\n"
           "with open(out, 'wb') as f:\n"
           "    try:\n"
           "        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode\n"
           "    except OSError as exc:\n"
           "        f.write(repr(exc).encode())\n"
           "        code = 127\n"
           "with open(rc + '.part', 'w') as f:\n"
           "    f.write(str(code))\n"
           "os.replace(rc + '.part', rc)\n")


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    tool: str  # an executable of the environment (found next to this Python first, then on PATH)
    args: tuple[str, ...] = ()
    timeout_s: float = 600.0

    def argv(self) -> list[str] | None:
        exe = shutil.which(self.tool, path=str(Path(sys.executable).parent)) or shutil.which(self.tool)
        return None if exe is None else [exe, *self.args]


MYPY = Check("mypy", "mypy")  # its files and options: pyproject.toml's [tool.mypy]
CHECKS = {"tests/test_lint.py::test_mypy": MYPY}  # by the node id of the test that owns it


@dataclasses.dataclass
class Background:
    """The checks of one test run, in ``folder`` (shared by all the run's workers)."""

    folder: Path
    started: list[subprocess.Popen] = dataclasses.field(default_factory=list)

    def start(self, check: Check) -> bool:
        """Start ``check`` unless a worker of this run already did; False when it cannot start here."""
        argv = check.argv()
        if argv is None:
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.folder / f"{check.name}.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return True
        out, rc = self.folder / f"{check.name}.out", self.folder / f"{check.name}.rc"
        self.started.append(subprocess.Popen([sys.executable, "-c", _RUNNER, str(out), str(rc), *argv], cwd=ROOT,
                                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL))
        return True

    def result(self, check: Check) -> tuple[int, str]:
        """(exit status, output) of ``check``, waiting for it (started here first if no worker did)."""
        if not (self.folder / f"{check.name}.lock").exists() and not self.start(check):
            raise FileNotFoundError(f"{check.tool} not installed: pip install -e '.[dev]'")
        rc = self.folder / f"{check.name}.rc"
        deadline = time.monotonic() + check.timeout_s
        while not rc.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{check.name} did not finish within {check.timeout_s:.0f} s")
            time.sleep(0.5)
        return int(rc.read_text()), (self.folder / f"{check.name}.out").read_text(errors="replace")

    def close(self, timeout_s: float = 600.0) -> None:
        """Wait for the checks started here (another worker may still collect them), killing any that hang."""
        for proc in self.started:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
