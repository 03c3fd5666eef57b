"""What the tests read from /proc: processes (pid, parent, state, command line), a process's open
files and environment, and the kernel's TCP socket tables."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Proc:
    pid: int
    parent: int
    state: str  # "R", "S", ..., "Z" for a zombie
    cmdline: str  # arguments joined by spaces


def processes() -> Iterator[Proc]:
    """Every process that still has a /proc entry, zombies included."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        yield Proc(int(entry.name), int(fields[1]), fields[0], cmd)


def fd_targets(pid: int) -> Iterator[str]:
    """Where each open file descriptor of ``pid`` points (``socket:[inode]`` for sockets); nothing once
    the process is gone."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return
    for fd in fds:
        try:
            yield os.readlink(fd)
        except OSError:
            continue


def environ_of(pid: int) -> dict[str, str]:
    """A process's environment as it was started."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").partition("=")[::2] for kv in raw if b"=" in kv)


@dataclasses.dataclass(frozen=True)
class TcpSocket:
    local_addr: str  # hex, as the kernel prints it
    local_port: int
    remote_port: int
    state: str  # "0A" is LISTEN
    inode: int


def tcp_sockets() -> Iterator[TcpSocket]:
    """Every IPv4 and IPv6 TCP socket of this network namespace."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            addr, _, port = f[1].rpartition(":")
            yield TcpSocket(addr, int(port, 16), int(f[2].rsplit(":", 1)[1], 16), f[3], int(f[9]))
