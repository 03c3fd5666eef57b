"""Other local users: they cannot take the run dir or its sockets, read the API key from a command line,
or squat the ring's shared-memory name (the tests run as root and play the other user as uid 65534)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from helpers.procfs import environ_of, processes
from helpers.stack import MODEL, Stack, start_stack, stop_stack

from blink.cli import argv_without_key
from shared import ipc
from shared import messages as m
from shared.env import default_run_dir
from shared.ring import RingGeometry, attach_shm_ring, create_shm_ring
from shared.transport import SHM_DIR, SegmentTaken

ROOT = Path(__file__).resolve().parents[1]
OTHER = 65534  # "nobody"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root")


def blink(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "blink.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "BLINK_LOG_JSON": "1"})


def as_other_user(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked child as uid 65534; its exit status."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(OTHER)
            os.setuid(OTHER)
            code = body()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A folder the other user can reach (pytest's own temporary folders are closed to others)."""
    path = Path(f"/tmp/blink-users-{uuid.uuid4().hex[:8]}")
    path.mkdir(0o755)
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------- the run dir
def other_owned(path: Path) -> str:
    path.mkdir(0o700)
    os.chown(path, OTHER, OTHER)
    return f"owned by another user (owner uid {OTHER}, mode 0700)"


def open_to_all(path: Path) -> str:
    path.mkdir()
    path.chmod(0o777)
    return "open to other users (owner uid 0, mode 0777)"


def symlink(path: Path) -> str:
    target = path.with_name("target")
    target.mkdir(0o700)
    path.symlink_to(target)
    return "a symbolic link"


BAD_RUN_DIRS = {"other-owner": other_owned, "mode-0777": open_to_all, "symlink": symlink}
COMMANDS = ("serve", "gateway", "tokenizer", "tracker", "reader")


@as_root
@pytest.mark.parametrize("bad", BAD_RUN_DIRS)
def test_every_service_refuses_a_run_dir_that_is_not_private(tmp_path: Path, bad: str) -> None:
    run = tmp_path / "run"
    why = BAD_RUN_DIRS[bad](run)
    for command in COMMANDS:
        out = blink(command, "--run-dir", str(run))
        assert out.returncode == 2, (command, out.stderr[-2000:])
        assert f"blink {command}: run dir {run} is {why}" in out.stderr, (command, out.stderr[-2000:])
        assert "mode 0700" in out.stderr
    assert not list(run.iterdir())  # no socket or marker was put in it


def test_run_dir_is_created_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        run = ipc.ensure_run_dir(tmp_path / "a" / "run")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(run).st_mode) == 0o700 and os.lstat(run).st_uid == os.geteuid()


def test_default_run_dir_is_xdg_runtime_dir_only_when_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert default_run_dir() == xdg / "blink"
    xdg.chmod(0o755)
    assert default_run_dir() == Path(f"/tmp/blink-{os.geteuid()}")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_run_dir() == Path(f"/tmp/blink-{os.geteuid()}")


async def test_service_sockets_are_0600(tmp_path: Path) -> None:
    server = await ipc.serve(tmp_path / "run", "tokenizer", m.ToTokenizer, lambda chan: asyncio.sleep(0))
    try:
        st = os.lstat(ipc.socket_path(tmp_path / "run", "tokenizer"))
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(tmp_path / "run").st_mode) == 0o700
    finally:
        server.close()


@as_root
async def test_a_socket_planted_by_another_user_is_refused(open_tmp: Path) -> None:
    """The attack: another user's process listens on tokenizer.sock. The gateway must not talk to it."""
    run = ipc.ensure_run_dir(open_tmp / "run")
    path = ipc.socket_path(run, "tokenizer")
    ready_r, ready_w = os.pipe()
    run.chmod(0o777)  # long enough for the other user to plant a socket, then private again

    def plant() -> int:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
            s.listen()
            os.write(ready_w, b"1")
            conn, _ = s.accept()
            return 0 if conn.recv(1) == b"" else 3  # hung up on without a byte sent

    pid = os.fork()
    if pid == 0:
        os.setgid(OTHER)
        os.setuid(OTHER)
        os._exit(plant())
    assert os.read(ready_r, 1) == b"1"
    run.chmod(0o700)
    with pytest.raises(ipc.RunDirError, match=f"{path} is served by uid {OTHER}, not by uid 0"):
        await asyncio.wait_for(ipc.connect(run, "tokenizer", m.FromTokenizer), 10)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@as_root
async def test_a_peer_of_another_user_is_hung_up_on(open_tmp: Path) -> None:
    run = open_tmp / "run"
    seen: list[object] = []

    async def on_channel(chan: ipc.Channel) -> None:
        seen.append(chan)

    server = await ipc.serve(run, "tracker", m.ToTracker, on_channel)
    path = ipc.socket_path(run, "tracker")
    run.chmod(0o711)  # a mistake that lets others reach the socket
    path.chmod(0o666)

    def knock() -> int:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(path))
            try:
                s.sendall(b"\x00\x00\x00\x00")
                return 0 if s.recv(1) == b"" else 3
            except (ConnectionResetError, BrokenPipeError):  # hung up on, our bytes unread (or not yet sent)
                return 0

    try:
        code = await asyncio.to_thread(as_other_user, knock)
    finally:
        server.close()
    assert code == 0 and seen == []


# ---------------------------------------------------------------------- the API key
def test_the_key_is_taken_off_serves_command_line() -> None:
    argv = ["python", "-m", "blink.cli", "serve", "--port", "1", "--api-key", "K1", "--gateways", "2"]
    assert argv_without_key(argv, "K1") == ["python", "-m", "blink.cli", "serve", "--port", "1", "--gateways", "2"]
    assert argv_without_key(["blink", "serve", "--api-key=K1"], "K1") == ["blink", "serve"]
    assert argv_without_key(["blink", "serve", "--api-k", "K1"], "K1") == ["blink", "serve"]
    assert argv_without_key(["blink", "serve"], "K1") is None  # from BLINK_API_KEY: nothing to hide
    assert argv_without_key(["-m", "blink.cli", "serve", "--api-key", "blink"], "blink") == ["-m", "blink.cli", "serve"]


async def status_of(stack: Stack, headers: dict[str, str]) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(stack.url + "/v1/chat/completions", json=body, headers=headers) as r:
            return r.status


@pytest.mark.parametrize("given", ["flag", "env"])
async def test_the_api_key_is_on_no_command_line_and_still_enforced(tmp_path: Path, given: str) -> None:
    key = f"key-{uuid.uuid4().hex}"
    if given == "flag":
        stack = start_stack(tmp_path, api_key=key)
    else:
        stack = start_stack(tmp_path, env={"BLINK_API_KEY": key})
    try:
        leaks = [p for p in processes() if key in p.cmdline]
        assert leaks == []
        children = stack.children()
        assert set(children) >= {"engine", "tokenizer", "reader", "tracker", "gateway-0"}
        for role, pid in children.items():
            assert (environ_of(pid).get("BLINK_API_KEY") == key) is role.startswith("gateway"), role
        assert await status_of(stack, {}) == 401
        assert await status_of(stack, {"Authorization": f"Bearer {key}"}) == 200
        assert stat.S_IMODE(os.lstat(stack.run_dir).st_mode) == 0o700
    finally:
        assert stop_stack(stack) == 0


# ---------------------------------------------------------------------- the ring's name
GEO = RingGeometry(4, 8, 8, 1)


def squat(name: str) -> bytes:
    """Another user's segment under ``name``; its bytes."""
    data = b"not yours" * 500
    path = SHM_DIR / name
    path.write_bytes(data)
    os.chown(path, OTHER, OTHER)
    path.chmod(0o644)
    return data


@as_root
def test_a_segment_of_another_user_is_never_mapped_nor_removed(ring_name: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    data = squat(ring_name)
    maps: list[object] = []
    real_mmap = __import__("mmap").mmap
    monkeypatch.setattr("shared.transport.mmap.mmap", lambda *a, **k: maps.append(a) or real_mmap(*a, **k))
    for open_it in (lambda: create_shm_ring(ring_name, GEO), lambda: attach_shm_ring(ring_name)):
        with pytest.raises(SegmentTaken) as err:
            open_it()
        assert f"{SHM_DIR / ring_name} is a segment owned by uid {OTHER} (mode 0644)" in str(err.value)
        assert "--ring" in str(err.value)
    st = os.lstat(SHM_DIR / ring_name)
    assert (st.st_uid, (SHM_DIR / ring_name).read_bytes(), maps) == (OTHER, data, [])


def test_a_symlink_under_the_rings_name_is_not_followed(ring_name: str, tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    (SHM_DIR / ring_name).symlink_to(target)
    for open_it in (lambda: create_shm_ring(ring_name, GEO), lambda: attach_shm_ring(ring_name)):
        with pytest.raises(SegmentTaken, match="is a symbolic link"):
            open_it()
    assert target.read_bytes() == b"keep me" and (SHM_DIR / ring_name).is_symlink()


@as_root
def test_serve_refuses_a_ring_name_taken_by_another_user(ring_name: str, tmp_path: Path) -> None:
    squat(ring_name)
    out = blink("serve", "--ring", ring_name, "--run-dir", str(tmp_path / "run"),
                "--engine-module", "tests.helpers.fake_engine")
    assert out.returncode == 2
    assert f"blink serve: ring {ring_name}: {SHM_DIR / ring_name} is a segment owned by uid {OTHER}" in out.stderr
    assert os.lstat(SHM_DIR / ring_name).st_uid == OTHER
