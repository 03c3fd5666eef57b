"""Blink on Ray Serve: one whole ``blink serve`` per replica (per host or GPU), one OpenAI-compatible endpoint.

Each replica of the ``BlinkReplica`` deployment starts a ``blink serve`` as its child process (its own
port on 127.0.0.1, ring and run dir; the child gets SIGTERM if the replica's process dies) and proxies
every HTTP request to it unchanged, streaming the response body back as it comes (SSE included). Ray
Serve does the rest, with nothing of Blink's own on top:

- **routing**: Serve's default request router (power of two choices over the replicas' queue lengths).
  A replica holds each request for as long as its Blink serves it, so its queue length is the number
  of requests in its Blink; ``max_ongoing_requests`` bounds it (set it to the replica's ``--num-slots``
  plus what may wait). ``record_routing_stats`` also reports each Blink's own gauges (waiting, running,
  slots in use, KV usage) for a custom request router or for inspection.
- **health**: ``check_health`` fails when the child exited or its ``/health`` is not 200 (a degraded
  ``--data-parallel-size`` Blink still answers 200); Serve then replaces the replica.
- **restart**: a replica that dies or fails its health check is restarted by Serve's controller.
- **placement**: ``--gpus-per-replica 1`` asks Ray for one GPU per replica (Ray sets
  ``CUDA_VISIBLE_DEVICES``, which the child inherits); 0 runs CPU engines.

Run: ``python -m blink.ray_serve --replicas 2 --port 8000 -- --backend cpu`` (the arguments after ``--`` go
to every replica's ``blink serve``), or ``serve run blink.ray_serve:app_builder replicas=2
serve_args="--backend persistent"``. It needs the ``ray`` extra: ``pip install 'blink-serve[ray]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from ray import serve
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from blink.supervisor import _die_with_parent

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
REPLICA_HEADER = "x-blink-replica"  # which replica answered (its Ray replica id)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """What each replica runs: ``blink serve`` with ``serve_args``, ready within ``startup_timeout_s``."""

    serve_args: tuple[str, ...] = ()
    startup_timeout_s: float = 600.0
    health_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for flag in ("--port", "--host", "--ring", "--run-dir"):
            if any(a == flag or a.startswith(flag + "=") for a in self.serve_args):
                raise ValueError(f"{flag} is chosen by each replica; leave it out of the serve arguments")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout_s: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


class BlinkProcess:
    """One ``blink serve`` child on 127.0.0.1: start, wait for ``/health``, stop (nothing left behind)."""

    def __init__(self, cfg: ReplicaConfig) -> None:
        self.cfg = cfg
        self.port = _free_port()
        tag = uuid.uuid4().hex[:10]
        self.ring = f"blink-ray-{tag}"
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"blink-ray-{tag}-"))  # 0700, short enough for sockets
        argv = [sys.executable, "-m", "blink.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--ring", self.ring, "--run-dir", str(self.run_dir), *cfg.serve_args]
        self.proc = subprocess.Popen(argv, preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"blink serve exited with {self.proc.returncode} before it was ready")
            if _get(self.url + "/health", 2.0) == 200:
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"blink serve was not ready within {self.cfg.startup_timeout_s} s")

    def problem(self) -> str | None:
        """Why this Blink does not serve (None while it does)."""
        if self.proc.poll() is not None:
            return f"blink serve exited with {self.proc.returncode}"
        status = _get(self.url + "/health", self.cfg.health_timeout_s)
        return None if status == 200 else f"blink serve /health answered {status or 'nothing'}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}


def _reply_headers(resp: aiohttp.ClientResponse, replica: str) -> dict[str, str]:
    out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
    out[REPLICA_HEADER] = replica
    return out


@serve.deployment(health_check_period_s=2.0, health_check_timeout_s=10.0, graceful_shutdown_timeout_s=30.0,
                  max_ongoing_requests=64)
class BlinkReplica:
    def __init__(self, cfg: ReplicaConfig) -> None:
        self.blink = BlinkProcess(cfg)
        self.blink.wait_ready()
        self.session: aiohttp.ClientSession | None = None
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id if context is not None else str(os.getpid())

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None or self.session.closed:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
            self.session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        return self.session

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        resp = await self._session().request(request.method, self.blink.url + request.url.path,
                                             params=request.query_params, data=body,
                                             headers=_forward_headers(request))
        headers = _reply_headers(resp, self.replica)
        if resp.content_type != "text/event-stream":
            try:
                return Response(await resp.read(), resp.status, headers)
            finally:
                resp.release()
        return StreamingResponse(_relay(resp), resp.status, headers)

    def check_health(self) -> None:
        problem = self.blink.problem()
        if problem:
            raise RuntimeError(problem)

    def record_routing_stats(self) -> dict[str, float]:
        """This Blink's load gauges from its ``/metrics`` (for a custom request router; Serve's default one
        routes by queue length)."""
        try:
            with urllib.request.urlopen(self.blink.url + "/metrics", timeout=2.0) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, OSError):
            return {}
        return load_gauges(text)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.blink.stop()


async def _relay(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.content.iter_any():
            yield chunk
    finally:
        resp.release()


LOAD_GAUGES = ("blink:num_requests_waiting", "blink:num_requests_running", "blink:slots_in_use",
               "blink:kv_cache_usage_perc")


def load_gauges(text: str) -> dict[str, float]:
    """The load gauges of a Blink ``/metrics`` text, by short name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in LOAD_GAUGES:
            out[name.split(":", 1)[1]] = float(line.rsplit(" ", 1)[1])
    return out


def build(replicas: int, serve_args: tuple[str, ...] = (), gpus_per_replica: float = 0.0,
          cpus_per_replica: float = 1.0, max_ongoing_requests: int = 64) -> Any:
    """The Serve application: ``replicas`` copies of one ``blink serve``."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    options: dict[str, Any] = {"num_cpus": cpus_per_replica}
    if gpus_per_replica:
        options["num_gpus"] = gpus_per_replica
    deployment = BlinkReplica.options(num_replicas=replicas, ray_actor_options=options,  # type: ignore[attr-defined]
                                      max_ongoing_requests=max_ongoing_requests)
    return deployment.bind(ReplicaConfig(tuple(serve_args)))


def app_builder(args: dict[str, str]) -> Any:
    """For ``serve run blink.ray_serve:app_builder replicas=2 serve_args="..." gpus_per_replica=1``."""
    return build(int(args.get("replicas", 1)), tuple(shlex.split(args.get("serve_args", ""))),
                 float(args.get("gpus_per_replica", 0)), float(args.get("cpus_per_replica", 1)),
                 int(args.get("max_ongoing_requests", 64)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blink.ray_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=1, help="Blink replicas (one per host or GPU)")
    ap.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs Ray gives each replica")
    ap.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    ap.add_argument("--max-ongoing-requests", type=int, default=64, help="requests one replica holds at once")
    ap.add_argument("--host", default="127.0.0.1", help="address of Serve's HTTP proxy")
    ap.add_argument("--port", type=int, default=8000, help="port of Serve's HTTP proxy")
    ap.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then blink serve's arguments")
    a = ap.parse_args(argv)
    import ray

    ray.init(address=a.address)
    serve.start(http_options={"host": a.host, "port": a.port})
    extra = tuple(a.serve_args[1:] if a.serve_args[:1] == ["--"] else a.serve_args)
    serve.run(build(a.replicas, extra, a.gpus_per_replica, a.cpus_per_replica, a.max_ongoing_requests),
              name="blink", route_prefix="/")
    print(f"serving on http://{a.host}:{a.port}/v1 (Ctrl-C stops)", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        signal.pause()
    serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
