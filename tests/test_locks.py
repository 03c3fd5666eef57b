"""The server locks (``blink/locks.py``) in process: a lock folder another user could have made is refused, a
held lock names its holder, and release leaves the lock files in place (removing one that another server has
open would let two servers lock files of the same name)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from blink import locks
from blink.locks import Owner, ServerLocks, ServerRunning


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(locks, "SHM_DIR", tmp_path)
    return tmp_path


def test_a_lock_folder_open_to_others_is_refused(shm: Path) -> None:
    folder = shm / f"blink-locks-{os.geteuid()}"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)  # as another user could leave it, in a directory anyone may write
    with pytest.raises(ServerRunning, match="not a private directory"):
        locks.lock_folder()
    os.chmod(folder, 0o700)
    assert locks.lock_folder() == folder


def test_a_held_ring_names_its_holder_and_release_keeps_the_files(shm: Path, tmp_path: Path) -> None:
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    run_a.mkdir(mode=0o700)
    run_b.mkdir(mode=0o700)
    first = ServerLocks(run_a, ("ring-x",), 8123)
    first.acquire(Owner(os.getpid(), str(run_a), "ring-x", 8123))
    second = ServerLocks(run_b, ("ring-x",), 8124)
    with pytest.raises(ServerRunning, match=rf"ring ring-x is already served by blink serve pid {os.getpid()}"):
        second.acquire(Owner(os.getpid(), str(run_b), "ring-x", 8124))
    assert second.held == []  # none kept: the run dir's lock it took first is released again
    first.release()
    folder = locks.lock_folder()
    assert (folder / "ring-ring-x.lock").exists() and (folder / "port-8123.lock").exists()
    second.acquire(Owner(os.getpid(), str(run_b), "ring-x", 8124))
    second.release()
