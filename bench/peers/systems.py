"""The systems a peer study serves: Blink (``blink serve`` of this checkout) and peers started from a command line.

A peer is any OpenAI-compatible server: the study runs its command (through ``bash -c``, in a session of its
own so that stopping it signals its whole process group), waits for its health URL, reads its waiting and
running gauges from ``/metrics`` and parses its version and effective settings from its log. Its *kind* says
how: ``vllm``, ``blink`` (a ``blink serve`` started from a command line, as the CPU test does) or ``openai``
(nothing but the API: no gauges, no settings).

Commands take placeholders, filled in shell-quoted: ``{model}`` (the model folder), ``{port}``,
``{max_num_seqs}`` (Blink's max batch; none under ``--config defaults``, where each system keeps its own),
``{max_model_len}``, ``{served_name}`` and ``{python}`` (this interpreter). vLLM's own command has a form per
config: ``tuned128`` gives it --max-num-seqs, ``defaults`` only the model, --max-model-len and what the harness
needs (the dummy weights, the served name, the address).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import string
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from harness.serve_proc import ROOT, ServeProc, free_port, http_get, parse_metrics

VLLM_COMMAND = ("vllm serve {model} --load-format dummy --served-model-name {served_name} "
                "--max-model-len {max_model_len} --max-num-seqs {max_num_seqs} --host 127.0.0.1 --port {port}")
VLLM_DEFAULTS_COMMAND = VLLM_COMMAND.replace(" --max-num-seqs {max_num_seqs}", "")
PLACEHOLDERS = ("model", "port", "max_num_seqs", "max_model_len", "served_name", "python", "precision")
NAME = re.compile(r"^[a-z][a-z0-9_.-]*$")
BLINK_MODES = ("persistent", "host")
# what vLLM needs beside tokenizer.json to load the tokenizer of a bare model folder
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                    "eos_token": "<|eot_id|>", "model_max_length": 8192}


# ---------------------------------------------------------------------- reading logs
VLLM_PATTERNS: tuple[tuple[str, str, Callable[[str], Any]], ...] = (
    ("version", r"vLLM API server version (\S+)", str),
    ("version", r"LLM engine \(v([^)]+)\)", str),
    ("max_num_batched_tokens", r"max_num_batched_tokens[=:' ]+(\d+)", int),
    ("chunked_prefill", r"Chunked prefill is (enabled)", lambda v: True),
    ("chunked_prefill", r"chunked_prefill_enabled=(True|False)", lambda v: v == "True"),
    ("prefix_caching", r"enable_prefix_caching=(True|False)", lambda v: v == "True"),
    ("max_num_seqs", r"max_num_seqs[=:' ]+(\d+)", int),
    ("kv_cache_tokens", r"GPU KV cache size: ([\d,]+) tokens", lambda v: int(v.replace(",", ""))),
    ("kv_cache_gib", r"Available KV cache memory: ([\d.]+) GiB", float),
    ("max_concurrency", r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", float),
    ("attention_backend", r"Using (\w+) (?:attention )?backend", str),
)


def line_at(text: str, pos: int) -> str:
    """The whole line of ``text`` that holds position ``pos``, stripped."""
    end = text.find("\n", pos)
    return text[text.rfind("\n", 0, pos) + 1:end if end >= 0 else len(text)].strip()


def parse_vllm_log(text: str) -> dict[str, Any]:
    """vLLM's version and effective settings, from the lines its start-up logs (the first match of each)."""
    out: dict[str, Any] = {}
    lines: list[str] = []
    for key, pattern, convert in VLLM_PATTERNS:
        if key in out:
            continue
        match = re.search(pattern, text)
        if match:
            out[key] = convert(match.group(1))
            lines.append(line_at(text, match.start())[:400])
    out["log_lines"] = list(dict.fromkeys(lines))
    return out


def parse_blink_log(text: str) -> dict[str, Any]:
    """Blink's settings from its JSON log: the CPU engine's ``model loaded`` event, the GPU engines' ``KV cache``
    event (the cache's blocks, block size, element type and GiB), and whether the engine caches prefixes (the GPU
    engines' ``prefix caching`` event; the CPU engine's ``model loaded`` says too). ``kv_cache_tokens``: blocks
    times block size, beside vLLM's figure of the same name."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if not line.startswith("{") or not any(f'"{e}"' in line for e in ("model loaded", "prefix caching",
                                                                         "KV cache")):
            continue
        with contextlib.suppress(json.JSONDecodeError):
            event = json.loads(line)
            if event.get("event") == "prefix caching":
                out["prefix_caching"] = bool(event.get("on"))
            elif event.get("event") == "model loaded" and "kv_blocks" not in out:
                out.update({k: event[k] for k in ("kv_blocks", "block_size", "max_context", "threads", "family",
                                                  "prefix_caching") if k in event})
            elif event.get("event") == "KV cache" and "kv_blocks" not in out:
                out.update({"kv_blocks": event.get("blocks"), "block_size": event.get("block_size"),
                            **{f"kv_cache_{k}": event[k] for k in ("dtype", "gib") if k in event}})
    if isinstance(out.get("kv_blocks"), int) and isinstance(out.get("block_size"), int):
        out["kv_cache_tokens"] = out["kv_blocks"] * out["block_size"]
    return out


def blink_version(root: Path = ROOT) -> str:
    """This checkout's version: the project's version and the commit. A tree whose files differ from its HEAD (a
    copy sent to a GPU host, whose HEAD may be older than the code) adds ``.dirty`` and the git tree of its files
    (``.t`` and 12 hex digits): the commit that holds the same files has that tree, ``git log --format='%h %T'``."""
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]

    def git(*args: str, env: dict[str, str] | None = None) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=True,
                              env=env).stdout.strip()

    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = git("rev-parse", "--short", "HEAD")
        if not commit:
            return version
        if not git("status", "--porcelain"):
            return f"{version}+g{commit}"
        return f"{version}+g{commit}.dirty{working_tree(git)}"
    return version


def working_tree(git: Callable[..., str]) -> str:
    """``.t`` and the git tree of the working files (tracked and not ignored), by a private index; empty when git
    cannot tell."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.suppress(OSError, subprocess.SubprocessError):
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("read-tree", "HEAD", env=env)
        git("add", "-A", env=env)
        return ".t" + git("write-tree", env=env)[:12]
    return ""


@dataclasses.dataclass(frozen=True)
class PeerKind:
    """How to observe one kind of server: its health path, its gauges and its log."""

    health: str
    waiting_gauge: str | None
    running_gauge: str | None
    parse_log: Callable[[str], dict[str, Any]]
    default_commands: dict[str, str] | None = None  # by config (report.CONFIGS)
    cache_counters: tuple[str, str] | None = None  # prompt tokens looked up in / found in the prefix cache
    drop_env: tuple[str, ...] = ()  # variables of this process the server must not inherit


def _no_settings(text: str) -> dict[str, Any]:
    return {}


PEER_KINDS = {
    "vllm": PeerKind("/health", "vllm:num_requests_waiting", "vllm:num_requests_running", parse_vllm_log,
                     {"tuned128": VLLM_COMMAND, "defaults": VLLM_DEFAULTS_COMMAND},
                     ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
                     # Blink's device-launched graphs need eager module loading (scripts/gpu_run.sh exports it);
                     # vLLM runs as its users run it, loading CUDA modules lazily
                     drop_env=("CUDA_MODULE_LOADING",)),
    "blink": PeerKind("/health", "blink:num_requests_waiting", "blink:num_requests_running", parse_blink_log,
                      cache_counters=("blink:prefix_cache_queries_total", "blink:prefix_cache_hits_total")),
    "openai": PeerKind("/v1/models", None, None, _no_settings),
}


# ---------------------------------------------------------------------- peers
@dataclasses.dataclass(frozen=True)
class Peer:
    """A peer: its name in the results, its kind and its command (with placeholders)."""

    name: str
    kind: str
    command: str

    def __post_init__(self) -> None:
        if not NAME.match(self.name) or self.name in BLINK_MODES or self.name.startswith("blink-"):
            raise ValueError(f"peer name {self.name!r}: lower-case letters, digits, '_', '.', '-', starting with a "
                             f"letter; not {', '.join(BLINK_MODES)} or blink-*")
        if self.kind not in PEER_KINDS:
            raise ValueError(f"peer {self.name}: kind {self.kind!r} is not among {', '.join(PEER_KINDS)}")
        if not self.command.strip():
            raise ValueError(f"peer {self.name}: empty command")
        fields = {f for _, f, _, _ in string.Formatter().parse(self.command) if f is not None}
        unknown = fields - set(PLACEHOLDERS)
        if unknown:
            raise ValueError(f"peer {self.name}: unknown placeholders {sorted(unknown)}; known: {PLACEHOLDERS}")

    def with_flags(self, flags: tuple[str, ...]) -> Peer:
        """This peer with the study's precision ``flags`` (vLLM's names): at the end of a vLLM or Blink command,
        in place of ``{precision}`` in any other (whose server may name them otherwise); a command of another kind
        without the placeholder is refused when there are flags (the header would record a precision the server
        was never given)."""
        if "{precision}" in self.command:
            return dataclasses.replace(self, command=self.command.replace("{precision}", shlex.join(flags)))
        if not flags:
            return self
        if self.kind not in ("vllm", "blink"):
            raise ValueError(f"peer {self.name} (kind {self.kind}): put {{precision}} where its command takes "
                             f"{shlex.join(flags)} (or that server's own flags for them)")
        return dataclasses.replace(self, command=f"{self.command} {shlex.join(flags)}")

    @property
    def observer(self) -> PeerKind:
        return PEER_KINDS[self.kind]

    def render(self, values: dict[str, Any]) -> str:
        """The command with its placeholders filled (shell-quoted); a missing value is an error."""
        needed = {f for _, f, _, _ in string.Formatter().parse(self.command) if f}
        missing = sorted(f for f in needed if values.get(f) is None)
        if missing:
            raise ValueError(f"peer {self.name}: no value for {missing} (e.g. {{model}} needs a model folder, "
                             "not the embedded model)")
        return self.command.format(**{k: shlex.quote(str(v)) for k, v in values.items() if v is not None})


def parse_peer(text: str, config: str = "tuned128") -> Peer:
    """``NAME[:KIND][=COMMAND]``; the kind defaults to NAME when it is a kind, else ``openai``; the command to
    the kind's own for ``config`` (vLLM's ``vllm serve ...``)."""
    head, eq, command = text.partition("=")
    name, _, kind = head.strip().partition(":")
    kind = kind or (name if name in PEER_KINDS else "openai")
    if not eq:
        commands = PEER_KINDS[kind].default_commands if kind in PEER_KINDS else None
        default = (commands or {}).get(config)
        if default is None:
            raise ValueError(f"peer {text!r} needs a command: NAME[:KIND]=COMMAND")
        command = default
    return Peer(name.strip(), kind, command.strip())


def write_tokenizer_config(folder: Path) -> Path:
    """``tokenizer_config.json`` in a model folder (vLLM needs it beside ``tokenizer.json``); kept if present."""
    path = folder / "tokenizer_config.json"
    if not path.exists():
        path.write_text(json.dumps(TOKENIZER_CONFIG, indent=1) + "\n")
    return path


# ---------------------------------------------------------------------- running servers
class System(Protocol):
    """What the study needs of a running server."""

    name: str
    url: str

    def start(self, timeout_s: float) -> None: ...
    def stop(self) -> int: ...
    def gauges(self) -> tuple[float | None, float | None]: ...
    def cache_counters(self) -> tuple[float | None, float | None]: ...
    def pids(self) -> dict[str, int]: ...
    def describe(self) -> dict[str, Any]: ...
    def log_tail(self, n: int = 3000) -> str: ...


def group_members(pgid: int) -> dict[str, int]:
    """``{comm-pid: pid}`` of the live processes of one process group, from ``/proc``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            head, _, rest = (entry / "stat").read_text().rpartition(")")
            fields = rest.split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out[f"{head.partition('(')[2]}-{entry.name}"] = int(entry.name)
    return out


def descendants(pid: int) -> dict[str, int]:
    """``{comm-pid: pid}`` of a process and everything it started (that is still alive), from ``/proc``."""
    out: dict[str, int] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            comm = Path(f"/proc/{p}/comm").read_text().strip()
            out[f"{comm}-{p}"] = p
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
    return out


def alive(pid: int) -> bool:
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    return False


def cores_of(pid: int) -> str | None:
    """The cores a process may run on (``Cpus_allowed_list``)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return None


def read_gauges(url: str, waiting: str | None, running: str | None) -> tuple[float | None, float | None]:
    if waiting is None and running is None:
        return None, None
    status, body = http_get(url + "/metrics")
    values = parse_metrics(body.decode(errors="replace")) if status == 200 else {}
    return (values.get(waiting) if waiting else None), (values.get(running) if running else None)


def read_cache_counters(url: str, names: tuple[str, str] | None) -> tuple[float | None, float | None]:
    """The prefix cache's (queries, hits) counters in prompt tokens, as the server reports them."""
    return read_gauges(url, *names) if names is not None else (None, None)


class CommandServer:
    """A peer started from its command line in a session of its own; its output goes to ``work/NAME.log``."""

    def __init__(self, peer: Peer, values: dict[str, Any], work: Path) -> None:
        self.peer, self.name = peer, peer.name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = peer.render({**values, "port": self.port, "python": sys.executable})
        self.log_path = work / f"{peer.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def start(self, timeout_s: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            env = {k: v for k, v in os.environ.items() if k not in self.peer.observer.drop_env}
            self.proc = subprocess.Popen(["bash", "-c", self.command], cwd=ROOT, stdin=subprocess.DEVNULL, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        health = self.url + self.peer.observer.health
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"peer {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if http_get(health, timeout_s=2.0)[0] == 200:
                self.startup_s = round(time.monotonic() - t0, 1)
                return
            time.sleep(0.5)
        self.dump_stacks()
        raise RuntimeError(f"peer {self.name} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def dump_stacks(self, wait_s: float = 3.0) -> None:
        """Ask every process of a server that never came up where it is: SIGABRT, which a Python process run with
        ``PYTHONFAULTHANDLER=1`` answers by writing every thread's traceback to its log before it dies."""
        for pid in self.pids().values():
            if self.proc is not None and pid == self.proc.pid:
                continue  # the shell that ran the command
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(wait_s)

    def stop(self, grace_s: float = 30.0) -> int:
        """SIGTERM to the process group, SIGKILL (to the group and every process it started) after ``grace_s``;
        the command's exit code."""
        if self.proc is None:
            return 0
        tree = set(self.pids().values())
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            if sig == signal.SIGKILL:
                for pid in tree:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sig)
            end = time.monotonic() + wait_s
            while time.monotonic() < end and (group_members(self.proc.pid) or any(alive(p) for p in tree)):
                self.proc.poll()  # reaps the command itself
                time.sleep(0.2)
            if not group_members(self.proc.pid) and not any(alive(p) for p in tree):
                break
        return self.proc.wait()

    def gauges(self) -> tuple[float | None, float | None]:
        obs = self.peer.observer
        return read_gauges(self.url, obs.waiting_gauge, obs.running_gauge)

    def cache_counters(self) -> tuple[float | None, float | None]:
        return read_cache_counters(self.url, self.peer.observer.cache_counters)

    def pids(self) -> dict[str, int]:
        """The command's process group and every process it started."""
        if self.proc is None:
            return {}
        return {**group_members(self.proc.pid), **descendants(self.proc.pid)}

    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def describe(self) -> dict[str, Any]:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        settings = self.peer.observer.parse_log(text)
        version = settings.pop("version", None) or (blink_version() if self.peer.kind == "blink" else None)
        return {"kind": self.peer.kind, "command": self.command, "version": version, "settings": settings,
                "startup_s": self.startup_s, "cores": cores_of(self.proc.pid) if self.proc else None}


class BlinkServer:
    """``blink serve`` of this checkout in one mode, through ``harness.serve_proc``."""

    def __init__(self, mode: str, flags: tuple[str, ...], env: dict[str, str], work: Path) -> None:
        self.name = f"blink-{mode}"
        folder = re.sub(r"[^\w.-]+", "_", self.name).strip("_")  # a plain name, whatever --serve-args it names
        self.serve = ServeProc(flags, work / folder, env=env)
        self.url = self.serve.url
        self.startup_s: float | None = None

    def start(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        self.serve.start(timeout_s=timeout_s)
        self.startup_s = round(time.monotonic() - t0, 1)

    def stop(self) -> int:
        return self.serve.stop(timeout_s=45)

    def gauges(self) -> tuple[float | None, float | None]:
        obs = PEER_KINDS["blink"]
        return read_gauges(self.url, obs.waiting_gauge, obs.running_gauge)

    def cache_counters(self) -> tuple[float | None, float | None]:
        return read_cache_counters(self.url, PEER_KINDS["blink"].cache_counters)

    def pids(self) -> dict[str, int]:
        return self.serve.pids() if self.serve.proc is not None else {}

    def log_tail(self, n: int = 3000) -> str:
        return self.serve.log_tail(n)

    def describe(self) -> dict[str, Any]:
        settings = {**parse_blink_log(self.serve.log_tail(1 << 20)), "serve_args": list(self.serve.args)}
        proc = self.serve.proc
        return {"kind": "blink", "command": "blink serve " + " ".join(self.serve.args), "version": blink_version(),
                "settings": settings, "startup_s": self.startup_s, "cores": cores_of(proc.pid) if proc else None}
