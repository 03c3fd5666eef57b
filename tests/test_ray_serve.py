"""Blink on Ray Serve (``blink/ray_serve.py``): a local Ray cluster on this machine, two replicas of the embedded
model behind one endpoint; a streamed completion through it with the official ``openai`` client, requests on
both replicas, one replica killed: requests go to the other, and Ray starts a replacement.

On demand (a few minutes on a small machine; needs the ``ray`` extra, skipped without it)::

    pip install -e '.[ray]'
    python -m pytest -m ray tests/test_ray_serve.py -s
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from helpers.e2e import wait_for
from helpers.procfs import processes
from helpers.stack import MODEL

from harness.serve_proc import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
ray_serve = pytest.importorskip("blink.ray_serve")

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]
SERVE_ARGS = ("--backend", "cpu", "--threads", "1", "--num-slots", "8", "--max-prompt-tokens", "128",
              "--max-output-tokens", "64", "--kv-blocks", "256", "--no-standby-engine")
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
APP = "blink"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    port = free_port()
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "BLINK_HEARTBEAT_TIMEOUT_S": "10"}
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_serve.build(2, SERVE_ARGS, cpus_per_replica=1.0), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def replica_of_completion(url: str) -> str | None:
    """Which replica answered one short completion (None: it failed)."""
    try:
        raw = client(url).completions.with_raw_response.create(model=MODEL, prompt="Once upon a time",
                                                                max_tokens=4, temperature=0)
    except openai.APIError:
        return None
    assert raw.parse().choices[0].text
    return raw.headers.get(ray_serve.REPLICA_HEADER)


def replicas_of(url: str, n: int, concurrency: int) -> list[str | None]:
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda _: replica_of_completion(url), range(n)))


def replica_actors() -> dict[str, str]:
    """{replica unique id: actor name} of the Blink deployment's live replicas."""
    out = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if name.startswith(f"SERVE_REPLICA::{APP}#BlinkReplica#"):
            out[name.rsplit("#", 1)[1]] = name
    return out


def running_replicas() -> int:
    status = serve.status().applications[APP].deployments["BlinkReplica"]
    return int(status.replica_states.get("RUNNING", 0))


def test_two_replicas_stream_spread_and_survive_a_killed_one(endpoint: str) -> None:
    stream = client(endpoint).chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=16, temperature=0,
                                                      stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text and chunks[-1].choices[0].finish_reason in ("stop", "length"), text
    before = replicas_of(endpoint, 8, 4)
    assert None not in before and len(set(before)) == 2, before  # Serve's router used both replicas
    victim = before[0]
    assert victim is not None
    t_kill = time.monotonic()
    ray.kill(ray.get_actor(replica_actors()[victim], namespace="serve"), no_restart=True)
    after = [replica_of_completion(endpoint) for _ in range(6)]
    served = [r for r in after if r is not None]
    print(f"after the kill: {after} ({time.monotonic() - t_kill:.1f} s)")
    assert victim not in served and len(served) >= 5, after  # the other replica serves them
    deadline = time.monotonic() + 300
    while running_replicas() < 2 or victim in replica_actors():
        assert time.monotonic() < deadline, serve.status()
        time.sleep(1)
    print(f"replacement running {time.monotonic() - t_kill:.1f} s after the kill")
    assert len(replica_actors()) == 2 and victim not in replica_actors()
    # the killed replica's blink serve went with it (SIGTERM from the kernel when its parent died)
    wait_for(lambda: len(blink_serves()) == 2, 60, 0.5)


def blink_serves() -> list[int]:
    """Pids of the replicas' ``blink serve`` supervisors now."""
    return [p.pid for p in processes() if "blink.cli serve" in p.cmdline and "blink-ray-" in p.cmdline]
