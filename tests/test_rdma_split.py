"""The DPU split as processes: an engine started with ``--rdma-listen``, and ``blink serve --frontend-only --ring
rdma://HOST:PORT/NAME`` (gateway, tokenizer, tracker, reader), each service reaching the ring through its own
exchange and queue pair, ``RdmaTransport`` and the work-request plans. The one part that is not the product is the
verbs layer: both sides run with ``BLINK_RDMA_NIC`` naming the test harness's stand-in for the NIC
(``harness/rdma_standin.py``), which carries out the posted WRITEs, READs and atomics on the engine's registered
memory. Spoken to through the official ``openai`` client.

With the fake engine (``tests/helpers/fake_engine.py``): requests, liveness (a stopped engine's silent beat seen
through the transport), the reader's hand-over mid-stream, a tracker restarted, the engine restarted (a new
ring and registration at the same address). With the real CPU engine and the embedded model: a chat answered.
``--frontend-only`` also serves a local engine started apart.
Without a device (no stand-in named): every start refused at once, naming what is missing, nothing left running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from helpers.e2e import ENGINE_FLAGS, FRANCE, wait_for
from helpers.procfs import processes

from harness.serve_proc import MODEL, ROOT, ServeProc, free_port, http_get
from shared.transport import SHM_DIR

STANDIN = {"BLINK_RDMA_NIC": "harness.rdma_standin:SharedMemoryNic"}
# five seconds' silence is an engine down (the liveness test waits up to 30 s for it): short enough for that test,
# long past any stall a busy host puts in the fake engine's beat every 0.1 s (read through the transport, no
# credit for a starved engine applies) while the other tests stream
TIMEOUT = {"BLINK_HEARTBEAT_TIMEOUT_S": "5"}


@dataclasses.dataclass
class EngineProc:
    """An engine process that exports its ring on ``port`` (the GPU host's side)."""

    module: str
    ring: str
    port: int
    log: Path
    flags: tuple[str, ...] = ()
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"rdma://127.0.0.1:{self.port}/{self.ring}"

    def start(self, timeout_s: float = 60.0) -> EngineProc:
        env = {**os.environ, "BLINK_LOG_JSON": "1", **STANDIN, **self.env}
        before = self.exports()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", self.module, "--ring", self.ring, "--rdma-listen",
                                          f"127.0.0.1:{self.port}", *self.flags], cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT)
        wait_for(lambda: self.running() and self.exports() > before, timeout_s, every_s=0.1)
        return self

    def running(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the engine exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        return True

    def exports(self) -> int:
        """How many times the log says the ring was exported (a restart's export is the next one)."""
        if not self.log.exists():
            return 0
        return self.log.read_text().count('"event": "rdma export ready"')

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        (SHM_DIR / self.ring).unlink(missing_ok=True)  # a SIGKILLed engine leaves it


@dataclasses.dataclass
class Frontend(ServeProc):
    """``blink serve --frontend-only`` (the DPU's side); ``ring`` is the engine's rdma:// address."""

    @property
    def run_dir(self) -> Path:
        return Path("/tmp") / f"blink-run-dpu-{self.port}"

    def roles(self) -> dict[str, int]:
        return self.children()


def start_frontend(tmp: Path, engine: EngineProc, env: dict[str, str] | None = None) -> Frontend:
    fe = Frontend(("--frontend-only", "--no-standby-engine", "--drain-timeout", "2"), tmp,
                  env={**STANDIN, **(env or {})}, ring=engine.address)
    return fe.start(120)


def client(fe: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=fe.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def health(fe: Frontend) -> int:
    return http_get(fe.url + "/health")[0]


def served(fe: Frontend) -> bool:
    """Whether a request is answered now (a 503 while a service has not attached the ring yet is not)."""
    with contextlib.suppress(openai.APIStatusError, openai.APIConnectionError):
        return client(fe).completions.create(model=MODEL, prompt="one two", max_tokens=4).usage.total_tokens > 0
    return False


def attached_through_rdma(fe: Frontend) -> set[str]:
    """The services whose log says they attached the ring through ``RdmaTransport``."""
    return {line.split('"service": "')[1].split('"')[0] for line in fe.log_tail(10**7).splitlines()
            if '"event": "ring attached"' in line and '"transport": "RdmaTransport"' in line}


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProc, Frontend]]:
    tmp = tmp_path_factory.mktemp("dpu")
    engine = EngineProc("tests.helpers.fake_engine", f"blink-test-{uuid.uuid4().hex[:10]}", free_port(),
                        tmp / "engine.log", ("--step-ms", "10")).start()
    fe = None
    try:
        fe = start_frontend(tmp, engine, TIMEOUT)
        yield engine, fe
    finally:
        if fe is not None:
            fe.stop()
        engine.stop()


def test_a_request_reaches_the_engine_through_the_transport(split: tuple[EngineProc, Frontend]) -> None:
    engine, fe = split
    wait_for(lambda: health(fe) == 200, 30)
    got = client(fe).completions.create(model=MODEL, prompt="one two three four", max_tokens=8, temperature=0)
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens > 0
    # the gateway, the tracker and the reader each attached the ring over RDMA; the engine answered three exchanges
    wait_for(lambda: {"gateway-0", "tracker", "reader"} <= attached_through_rdma(fe), 30)
    connected = [line for line in engine.log.read_text().splitlines() if '"rdma frontend connected"' in line]
    assert len(connected) >= 3
    # no frontend process maps the ring by name: only the stand-in NIC's poster does, inside RdmaTransport
    assert fe.ring.startswith("rdma://") and "--frontend-only" in " ".join(fe.args)


def test_liveness_is_the_beat_read_through_the_transport(split: tuple[EngineProc, Frontend]) -> None:
    """A stopped engine (SIGSTOP) keeps its ring and its registration: the NIC still answers, and the frontend
    reads a silent beat counter, so /health turns 503 after the heartbeat timeout, and 200 once it beats again."""
    engine, fe = split
    wait_for(lambda: health(fe) == 200, 30)
    assert engine.proc is not None
    engine.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: health(fe) == 503, 30, every_s=0.1)
        status, body = http_get(fe.url + "/v1/completions")
        assert status in (405, 503)
    finally:
        engine.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: health(fe) == 200, 30, every_s=0.1)


def test_the_readers_hand_over_mid_stream_loses_no_token(split: tuple[EngineProc, Frontend]) -> None:
    """The reader killed while a stream runs: the supervisor restarts it, the new reader attaches the ring through
    its own exchange and queue pair, finds the stream's slot from the gateway's hello, and goes on from the first
    token the gateway lacks."""
    _, fe = split
    wait_for(lambda: health(fe) == 200, 30)
    stream = client(fe).completions.create(model=MODEL, prompt="alpha beta gamma delta epsilon", max_tokens=150,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
    texts: list[str] = []
    reasons = []
    killed = None
    for chunk in stream:
        texts += [c.text for c in chunk.choices]
        reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        if killed is None and len(texts) >= 10:
            killed = fe.roles()["reader"]
            os.kill(killed, signal.SIGKILL)
    assert killed is not None and reasons == ["length"]
    assert fe.roles()["reader"] != killed
    whole = client(fe).completions.create(model=MODEL, prompt="alpha beta gamma delta epsilon", max_tokens=150,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert "".join(texts) == whole.choices[0].text  # every token once, in order


def test_a_tracker_that_dies_is_restarted_and_serves(split: tuple[EngineProc, Frontend]) -> None:
    _, fe = split
    tracker = fe.roles()["tracker"]
    os.kill(tracker, signal.SIGKILL)
    wait_for(lambda: fe.roles().get("tracker") not in (None, tracker), 30, every_s=0.1)
    wait_for(lambda: served(fe), 60, every_s=0.2)


def test_an_engine_restarted_at_the_same_address_is_served_again(split: tuple[EngineProc, Frontend]) -> None:
    """The engine killed: its leases end at once, so the services let the ring go (503, not a hang); a new
    engine at the same address, with a new ring and a new registration, is attached again by every service."""
    engine, fe = split
    before = attached_through_rdma(fe)
    engine.stop(signal.SIGKILL)
    wait_for(lambda: health(fe) == 503, 30, every_s=0.1)
    with pytest.raises(openai.APIStatusError) as refused:
        client(fe).completions.create(model=MODEL, prompt="one two", max_tokens=4)
    assert refused.value.status_code == 503
    engine.start()
    wait_for(lambda: health(fe) == 200, 60, every_s=0.1)
    # each service attaches on its own (the gateway's /health says what the gateway sees): the tracker too, soon
    wait_for(lambda: served(fe), 60, every_s=0.1)
    assert before and "ring lost" in fe.log_tail(10**7)


def test_the_real_cpu_engine_answers_a_chat_through_the_transport(tmp_path: Path) -> None:
    """The real engine (CPU, the embedded SmolLM2) exports its ring; the frontend set on the "DPU" side answers
    the openai client, its tracker and reader going through RdmaTransport and the stand-in NIC; constrained output,
which needs the engine host's grammar store, is refused."""
    engine = EngineProc("gpu_engine.serve", f"blink-test-{uuid.uuid4().hex[:10]}", free_port(),
                        tmp_path / "engine.log", ENGINE_FLAGS, {"OMP_NUM_THREADS": "1"}).start(240)
    fe = None
    try:
        fe = start_frontend(tmp_path, engine)
        wait_for(lambda: health(fe) == 200, 120, every_s=0.2)
        c = client(fe)
        whole = c.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24, temperature=0)
        assert "Paris" in whole.choices[0].message.content
        streamed = c.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24, temperature=0, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
        assert text == whole.choices[0].message.content
        assert {"gateway-0", "tracker", "reader"} <= attached_through_rdma(fe)
        # constrained output: the engine loads grammars from its own host's shared memory, which the DPU cannot
        # write; a request that needs one is refused with a 400 that says so
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8,
                                      response_format={"type": "json_object"})
        assert refused.value.code == "unsupported_on_remote_ring"
        assert "not served over an RDMA ring" in refused.value.message
    finally:
        if fe is not None:
            fe.stop()
        engine.stop()
    assert not (SHM_DIR / engine.ring).exists()  # the engine unlinked its ring after its leases ended


def test_frontend_only_also_serves_a_local_engine_started_apart(tmp_path: Path) -> None:
    """--frontend-only with a local ring name: the engine started on its own on this host; the frontend set
    serves it and, stopping, leaves its ring alone (not its own)."""
    name = f"blink-test-{uuid.uuid4().hex[:10]}"
    with open(tmp_path / "engine.log", "wb") as out:
        engine = subprocess.Popen([sys.executable, "-m", "tests.helpers.fake_engine", "--ring", name], cwd=ROOT,
                                  stdout=out, stderr=subprocess.STDOUT)
    fe = None
    try:
        wait_for(lambda: (SHM_DIR / name).exists(), 30, every_s=0.1)
        fe = Frontend(("--frontend-only", "--no-standby-engine", "--drain-timeout", "2"), tmp_path, ring=name)
        fe.start(120)
        wait_for(lambda: health(fe) == 200, 30, every_s=0.1)
        assert client(fe).completions.create(model=MODEL, prompt="one two three", max_tokens=4).usage.total_tokens
        assert fe.stop() == 0
        fe = None
        assert (SHM_DIR / name).exists() and engine.poll() is None
    finally:
        if fe is not None:
            fe.stop()
        engine.terminate()
        engine.wait(30)
        (SHM_DIR / name).unlink(missing_ok=True)


# ---------------------------------------------------------------------- no RDMA device here
def own_processes_naming(text: str) -> list[int]:
    return [p.pid for p in processes() if text in p.cmdline]


def test_without_a_device_the_frontend_set_is_refused_at_once(tmp_path: Path) -> None:
    ring = f"rdma://127.0.0.1:{free_port()}/blink-test-{uuid.uuid4().hex[:10]}"
    env = {k: v for k, v in os.environ.items() if k != "BLINK_RDMA_NIC"}
    done = subprocess.run([sys.executable, "-m", "blink.cli", "serve", "--frontend-only", "--ring", ring,
                           "--run-dir", str(tmp_path / "run"), "--port", str(free_port())], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs pyverbs" in done.stderr and "apt-get install python3-pyverbs" in done.stderr
    assert own_processes_naming(ring) == []  # nothing was started
    for service in ("tracker", "reader", "gateway"):
        done = subprocess.run([sys.executable, "-m", "blink.cli", service, "--ring", ring, "--run-dir",
                               str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert f"blink {service}: --ring {ring}: the RDMA transport needs pyverbs" in done.stderr


def test_without_a_device_the_engine_refuses_its_export_before_loading(tmp_path: Path) -> None:
    name = f"blink-test-{uuid.uuid4().hex[:10]}"
    env = {k: v for k, v in os.environ.items() if k != "BLINK_RDMA_NIC"}
    done = subprocess.run([sys.executable, "-m", "gpu_engine.serve", "--ring", name, "--rdma-listen",
                           f"127.0.0.1:{free_port()}", *ENGINE_FLAGS], cwd=ROOT, env={**env, "BLINK_LOG_JSON": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "error: the RDMA transport needs pyverbs" in done.stderr
    assert '"loading weights"' not in done.stderr and not (SHM_DIR / name).exists()


def test_an_engine_whose_listen_address_does_not_resolve_says_so_in_one_line() -> None:
    name = f"blink-test-{uuid.uuid4().hex[:10]}"
    done = subprocess.run([sys.executable, "-m", "gpu_engine.serve", "--ring", name, "--rdma-listen",
                           "badhost.invalid:7471", *ENGINE_FLAGS], cwd=ROOT,
                          env={**os.environ, **STANDIN, "BLINK_LOG_JSON": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "error: --rdma-listen badhost.invalid:7471: cannot resolve 'badhost.invalid'" in done.stderr
    assert "Traceback" not in done.stderr and '"loading weights"' not in done.stderr
    assert not (SHM_DIR / name).exists()


def test_serve_help_shows_the_two_commands_of_a_dpu_deployment() -> None:
    text = subprocess.run([sys.executable, "-m", "blink.cli", "serve", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60).stdout
    assert "blink engine --model MODEL --ring blink-ring --rdma-listen 192.168.100.1:7471" in text
    assert "blink serve --frontend-only --model MODEL --ring rdma://192.168.100.1:7471/blink-ring" in text
    assert "--frontend-only" in text.split("a DPU deployment")[0]
