"""Every flag check that needs no model runs in ``blink serve`` before it starts any process, through the same
function the engine or the service runs (``EngineConfig.refusal_on``, ``gateway_config``, ``tracker_config``):
a refused flag ends ``blink serve`` at once with the reason and exit status 2, and nothing is started.

"Nothing is started" is seen from inside the ``blink serve`` process: a Python audit hook (``sys.addaudithook``)
counts every process it creates (``subprocess.Popen``, ``os.fork``, ``os.posix_spawn``, ``os.exec``); a run whose
flags pass the checks shows that the count sees the supervisor's children.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from blink.cli import build_parser, engine_problem, serve_config
from shared.config import GPU_MAX_CONTEXT, EngineConfig

ROOT = Path(__file__).resolve().parent.parent
CPU_HOST = not torch.cuda.is_available()
# blink serve, with a count of the processes it creates, printed as its last line of stderr.
COUNTED = """
import sys
spawned = []
sys.addaudithook(lambda event, args: spawned.append(event) if event in (
    "subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec") else None)
from blink.cli import main
try:
    code = main(sys.argv[1:])
finally:
    print(f"processes started: {len(spawned)}", file=sys.stderr)
sys.exit(code)
"""


def serve_counted(tmp_path: Path, *argv: str, timeout_s: float = 120) -> tuple[int, str, int]:
    """(exit status, stderr, processes started) of ``blink serve ARGV``."""
    ring = f"blink-test-{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "BLINK_RUN_DIR": str(tmp_path / "run"), "BLINK_RING_NAME": ring}
    got = subprocess.run([sys.executable, "-c", COUNTED, "serve", "--no-standby-engine", *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout_s)
    last = got.stderr.strip().splitlines()[-1]
    assert last.startswith("processes started: "), got.stderr[-2000:]
    return got.returncode, got.stderr, int(last.removeprefix("processes started: "))


def config_only_model(tmp_path: Path, context: int) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                    "max_position_embeddings": context}))
    return folder


@pytest.mark.parametrize(("argv", "reason"), [
    (["--max-model-len", "99999"], "--max-model-len 99999 is more than the model's context (8192)"),
    (["--max-connections", "0"], "gateway: max_connections must be >= 1, got 0"),
    (["--header-timeout", "0"], "gateway: header_timeout_s must be > 0, got 0.0"),
    (["--max-body-bytes", "10"], "gateway: max_body_bytes must be >= 1024, got 10"),
    (["--grammar-store-mb", "-1"], "gateway: --grammar-store-mb must be >= 0, got -1"),
    (["--port", "70000"], "gateway: --port must be within 0..65535, got 70000"),
    (["--max-waiting", "-1"], "tracker: max_waiting must be >= 0, got -1"),
    (["--backend", "cpu", "--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization applies to the GPU backends"),
    (["--backend", "cpu", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 runs on the GPU backends"),
    (["--gateways", "0"], "--gateways must be >= 1, got 0"),
    (["--tool-call-parser", "nope"], "--tool-call-parser: unknown parser 'nope'"),
    (["--tokenizer", "/no/such/tokenizer"], "--tokenizer: path /no/such/tokenizer does not exist"),
    (["--model", "/no/such/model"], "--model: path /no/such/model does not exist"),
    (["A/model", "--model", "B/model"], "two models given: A/model and --model B/model"),
])
def test_a_refused_flag_starts_nothing(tmp_path: Path, argv: list[str], reason: str) -> None:
    code, err, started = serve_counted(tmp_path, *argv)
    assert (code, started) == (2, 0), err[-2000:]
    assert f"blink serve: {reason}" in err


@pytest.mark.skipif(not CPU_HOST, reason="--backend auto picks the CPU backend only where no CUDA GPU is visible")
@pytest.mark.parametrize("argv", [["--gpu-memory-utilization", "0.9"], ["--kernel-plan", "cublas"],
                                  ["--gpu-weights", "dense"]])
def test_gpu_flags_under_auto_on_a_cpu_host_start_nothing(tmp_path: Path, argv: list[str]) -> None:
    """What --backend auto will pick is known before any process starts: a GPU flag is refused at once."""
    code, err, started = serve_counted(tmp_path, *argv)
    assert (code, started) == (2, 0), err[-2000:]
    assert f"{argv[0]} " in err and "applies to the GPU backends" in err
    assert "--backend auto runs the CPU backend here (no CUDA GPU is visible)" in err


def test_max_model_len_above_what_a_gpu_backend_runs_starts_nothing(tmp_path: Path) -> None:
    model = config_only_model(tmp_path, 32768)  # the model allows it; the GPU backends' graphs do not
    code, err, started = serve_counted(tmp_path, "--model", str(model), "--backend", "host", "--max-model-len", "16384")
    assert (code, started) == (2, 0), err[-2000:]
    assert f"--max-model-len 16384 is more than what this backend runs ({GPU_MAX_CONTEXT})" in err


def test_the_count_sees_the_processes_a_serve_starts(tmp_path: Path) -> None:
    """The other side of the count: flags that pass the checks start the supervisor's children (an engine module
    that does not exist makes the start fail, and blink serve stop)."""
    code, err, started = serve_counted(tmp_path, "--engine-module", "tests.no_such_engine", "--startup-timeout", "60")
    assert code != 0 and started >= 5, err[-2000:]  # the engine, tokenizer, reader, tracker and a gateway


def test_engine_problem_asks_the_hardware_only_when_the_backend_decides() -> None:
    """Under --backend auto a refusal that holds on every backend needs no look at the hardware; one that depends on
    the backend is decided by what auto picks here (the engine's rule: no CUDA GPU, the CPU backend)."""
    same = EngineConfig(max_model_len=9000)
    assert engine_problem(same, 8192) == "--max-model-len 9000 is more than the model's context (8192)"
    assert engine_problem(EngineConfig(max_model_len=9000), 32768) == (
        None if CPU_HOST else "--max-model-len 9000 is more than what this backend runs (8192): --backend auto runs "
        "a GPU backend here (a CUDA GPU is visible)")
    gpu_only = EngineConfig(gpu_memory_utilization=0.9)
    assert (engine_problem(gpu_only, None) is None) == (not CPU_HOST)
    assert engine_problem(EngineConfig(), 8192) is None


def test_serve_config_checks_flags_before_it_resolves_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub id with a refused flag: the refusal comes first, and nothing is asked of the Hub (no network here)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(["serve", "someone/some-model", "--max-connections", "0"])
    with pytest.raises(ValueError, match="gateway: max_connections must be >= 1, got 0"):
        serve_config(args)
    assert args.model == "someone/some-model"  # not resolved: the flags were refused first
