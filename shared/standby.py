"""The go a spare engine waits for: one line on its stdin, written by ``blink serve`` when an engine dies.

A spare (``--standby``) has done what a new engine can do beside the live one (interpreter, imports, config,
on the CPU the weights) and blocks reading its stdin, a pipe from the supervisor. The go names the ring of the
engine it replaces and that engine's extra environment (its GPU); from there the spare starts as that engine
would. The pipe closing without a go (the supervisor stopped or died) ends the spare.
"""

from __future__ import annotations

from typing import IO

import msgspec


class Go(msgspec.Struct, frozen=True):
    ring: str                              # the ring the spare creates and serves
    env: dict[str, str] = msgspec.field(default_factory=dict)  # the replaced engine's extra environment


def send_go(pipe: IO[bytes], go: Go) -> None:
    """Write the go and close the pipe (BrokenPipeError: the spare is gone)."""
    try:
        pipe.write(msgspec.json.encode(go) + b"\n")
        pipe.flush()
    finally:
        pipe.close()


class BadGo(ValueError):
    """A line on the spare's stdin that is not a go: someone typed at a spare started by hand."""


def wait_for_go(pipe: IO[bytes]) -> Go | None:
    """Block until the go; None when the pipe closed without one; BadGo for any other line."""
    line = pipe.readline()
    if not line:
        return None
    try:
        return msgspec.json.decode(line, type=Go)
    except msgspec.DecodeError as exc:  # ValidationError included
        got = line[:60].decode(errors="replace").strip()
        raise BadGo(f"--standby waits for blink serve's go on stdin, not {got!r}: {exc}") from None
