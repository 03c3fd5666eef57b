"""``blink serve`` takes vLLM's flag names where the meaning matches, refuses the rest with what to do
instead, shows every flag's default, and passes every flag on to the child that uses it."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch

from blink.cli import EMBEDDED_MODEL, build_parser, main, served_names
from blink.supervisor import ServeConfig, Supervisor
from dpu_tokenizer.chat import ChatTemplateError, chat_template_from_arg
from gpu_engine import serve as engine_serve
from gpu_engine.backend import CpuFormats, choose_backend
from shared.config import EngineConfig


def serve_ns(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def engine_of(argv: list[str]) -> EngineConfig:
    return EngineConfig.from_namespace(serve_ns(argv))


def children(argv: list[str]) -> Supervisor:
    ns = serve_ns(argv)
    return Supervisor(ServeConfig.from_args(ns, EngineConfig.from_namespace(ns)))


def child_args(child_argv: list[str]) -> argparse.Namespace:
    """A frontend child's command line (``python -m blink.cli SUB ...``) parsed by its own parser."""
    assert child_argv[:3] == [sys.executable, "-m", "blink.cli"]
    return build_parser().parse_args(child_argv[3:])


def test_max_model_len_is_the_one_context_limit() -> None:
    cfg = engine_of(["--max-model-len", "6144"])
    assert cfg.geometry.max_prompt_tokens == 6143  # a 6,000-token prompt fits
    assert cfg.context_limit(model_context=8192) == 6144
    assert engine_of(["--max-model-len", "6144", "--max-prompt-tokens", "1000"]).geometry.max_prompt_tokens == 1000
    with pytest.raises(ValueError, match="--max-model-len 6144 is more than the model's context .2048."):
        cfg.context_limit(model_context=2048)
    with pytest.raises(ValueError, match="what this backend runs"):
        cfg.context_limit(model_context=16384, cap=4096)
    default = engine_of([])  # unset: the default context, all of it but one token for the prompt (as vLLM)
    assert (default.context_limit(model_context=8192), default.geometry.max_prompt_tokens) == (6144, 6143)
    assert default.context_limit(model_context=2048) == 2048  # capped by the model's, not refused
    given = engine_of(["--max-prompt-tokens", "100", "--max-output-tokens", "7"])
    assert given.context_limit(model_context=8192) == 107  # the prompt slot given: the slots' capacity


@pytest.mark.parametrize("argv", [
    ["--max-model-len", "6144"],
    ["--max-model-len", "6144", "--max-prompt-tokens", "6143"],  # the default value, given: kept
    ["--max-model-len", "6144", "--max-prompt-tokens", "4096"],
    ["--max-prompt-tokens", "100", "--max-output-tokens", "7"],
    ["--max-num-seqs", "12", "--gpu-memory-utilization", "0.8", "--dtype", "half", "--backend", "host"],
    ["--max-batch", "12"],
])
def test_engine_flags_round_trip_through_the_supervisor(argv: list[str]) -> None:
    cfg = engine_of(argv)
    child = children(argv).engine.argv
    assert engine_serve.parse_args(child[3:]) == cfg


def test_max_num_seqs_and_its_alias_max_batch() -> None:
    assert engine_of(["--max-num-seqs", "7"]).max_batch == engine_of(["--max-batch", "7"]).max_batch == 7


@pytest.mark.parametrize(("argv", "seqs", "slots"), [
    (["--backend", "cpu"], 64, 256), (["--max-num-seqs", "200"], 200, 256), (["--max-num-seqs", "512"], 512, 640),
    (["--max-num-seqs", "1024", "--backend", "persistent"], 1024, 1280), (["--num-slots", "16"], 16, 16),
    (["--backend", "persistent", "--num-slots", "64"], 64, 64), (["--backend", "persistent"], 256, 320),
    (["--max-num-seqs", "512", "--num-slots", "512"], 512, 512)])
def test_ring_slots_follow_max_num_seqs(argv: list[str], seqs: int, slots: int) -> None:
    """A running sequence holds a ring slot: --num-slots left out is --max-num-seqs and a quarter more (at least
    256), so --max-num-seqs 512 runs 512 sequences (before, 256 slots bounded it); a given --num-slots is kept, and
    the config reaches the engine process unchanged."""
    cfg = engine_of(argv)
    assert (cfg.max_batch, cfg.geometry.num_slots) == (seqs, slots)
    assert engine_serve.parse_args(children(argv).engine.argv[3:]) == cfg


def test_a_config_built_without_the_parser_gets_the_same_slots_and_parses_back() -> None:
    """EngineConfig(max_batch=512) (the ring's default geometry) widens its ring as the parser does, so its flags
    parse back to it; past the slots the header's flip bits cover, the quarter more is dropped, never the batch."""
    from shared.config import slots_for
    from shared.ring import FLIP_SLOTS

    cfg = EngineConfig(max_batch=512)
    assert cfg.geometry.num_slots == 640
    assert engine_serve.parse_args(cfg.to_argv()) == cfg
    assert slots_for(3000) == 3750 and slots_for(3500) == FLIP_SLOTS == 4096
    assert slots_for(4000) == 4096 and slots_for(5000) == 5000
    assert EngineConfig(max_batch=4, geometry=EngineConfig().geometry).geometry.num_slots == 256
    for argv in (["--num-slots", "256", "--max-num-seqs", "210"], ["--max-num-seqs", "230"]):  # given: kept
        cfg = engine_of(argv)
        assert engine_serve.parse_args(cfg.to_argv()) == cfg
    assert engine_of(["--num-slots", "256", "--max-num-seqs", "210"]).geometry.num_slots == 256
    assert EngineConfig(max_batch=230).geometry.num_slots == 256  # holds the batch: the default stays


def test_max_num_seqs_left_out_follows_the_backend_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """256 sequences on a GPU backend (its ring a quarter wider), 64 on the CPU; --backend auto takes the GPU's
    only where a GPU is visible; either way the flags parse back to the same config (the engine's child derives
    what the supervisor derived)."""
    from shared import config

    given = ["--backend", "host", "--max-num-seqs", "64"]
    for argv, batch, slots in ((["--backend", "persistent"], 256, 320), (["--backend", "host"], 256, 320),
                               (["--backend", "cpu"], 64, 256), (given, 64, 256)):
        cfg = engine_of(argv)
        assert (cfg.max_batch, cfg.geometry.num_slots) == (batch, slots), argv
        assert engine_serve.parse_args(cfg.to_argv()) == cfg
    # a config built without the parser takes the same default and the same ring, or stays within a ring given
    assert EngineConfig(backend="persistent") == engine_of(["--backend", "persistent"])
    assert (EngineConfig(backend="cpu").max_batch, EngineConfig(backend="cpu").geometry.num_slots) == (64, 256)
    small = EngineConfig(backend="host", geometry=dataclasses.replace(EngineConfig().geometry, num_slots=32))
    assert small.max_batch == 32 and engine_serve.parse_args(small.to_argv()) == small
    with pytest.raises(ValueError, match="--max-num-seqs must be >= 1, got 0"):  # 0 is not "left out"
        engine_of(["--max-num-seqs", "0"])
    monkeypatch.setattr(config, "gpu_visible", lambda: True)
    assert engine_of([]).max_batch == 256 and engine_of(["--backend", "cpu"]).max_batch == 64
    seen = engine_of([])  # under auto the batch it derived is passed on: an engine that sees no GPU keeps it
    monkeypatch.setattr(config, "gpu_visible", lambda: False)
    assert "--max-num-seqs" in seen.to_argv() and engine_serve.parse_args(seen.to_argv()) == seen
    assert engine_of([]).max_batch == 64
    monkeypatch.undo()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # every GPU hidden: the engine would run on the CPU
    assert not config.gpu_visible() and engine_of([]).max_batch == 64


def test_num_slots_below_an_explicit_max_num_seqs_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="--num-slots 256 holds fewer requests than --max-num-seqs 512"):
        engine_of(["--max-num-seqs", "512", "--num-slots", "256"])
    assert main(["serve", "--max-num-seqs", "300", "--num-slots", "100"]) == 2
    assert "give --num-slots of at least 300" in capsys.readouterr().err


def test_gpu_memory_utilization_is_the_gpu_kv_budget_and_refused_on_the_cpu(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_of(["--gpu-memory-utilization", "0.8"]).kv_memory_fraction == 0.8
    assert engine_of([]).kv_memory_fraction == 0.9
    with pytest.raises(ValueError, match="the CPU backend's KV cache is sized by --kv-blocks"):
        engine_of(["--backend", "cpu", "--gpu-memory-utilization", "0.9"])
    with pytest.raises(ValueError, match=r"must be in \(0, 1\], got 1.5"):
        engine_of(["--gpu-memory-utilization", "1.5"])
    assert main(["serve", "--backend", "cpu", "--gpu-memory-utilization", "0.9"]) == 2
    assert "--gpu-memory-utilization applies to the GPU backends" in capsys.readouterr().err


@pytest.mark.parametrize(("given", "cpu", "gpu"), [
    ("auto", (True, torch.float32, torch.float16), "bfloat16"),
    ("float32", (False, torch.float32, torch.float32), "float32"),
    ("half", (False, torch.float16, torch.float16), "float16"),
    ("float16", (False, torch.float16, torch.float16), "float16"),
    ("bfloat16", (False, torch.bfloat16, torch.bfloat16), "bfloat16")])
def test_dtype_names(given: str, cpu: tuple[bool, torch.dtype, torch.dtype], gpu: str) -> None:
    cfg = engine_of(["--dtype", given])
    fmt = CpuFormats.for_dtype(cfg.dtype)
    assert ((fmt.packed, fmt.weight_dtype, fmt.kv_dtype), cfg.gpu_torch_dtype_name()) == (cpu, gpu)


def test_backend_auto_is_the_default_and_resolves_by_the_hardware() -> None:
    assert engine_of([]).backend == "auto"
    assert choose_backend(False, None, None)[0] == "cpu"
    assert choose_backend(True, (9, 0), "/usr/local/cuda/bin/nvcc")[0] == "persistent"
    assert choose_backend(True, (9, 0), None) == ("host", "sm_90 GPU but no nvcc to build the persistent scheduler")
    assert choose_backend(True, (8, 0), "/usr/bin/nvcc")[0] == "host"


@pytest.mark.parametrize(("argv", "message"), [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: tensor parallelism is not supported; Blink runs "
     "one engine per GPU: see --data-parallel-size"),
    (["-tp", "4"], "-tp 4: tensor parallelism is not supported"),
    (["--pipeline-parallel-size", "2"], "pipeline parallelism is not supported"),
    (["--quantization", "awq"], "invalid choice: 'awq'"),
    (["--kv-cache-dtype", "fp8_e5m2"], "argument --kv-cache-dtype: invalid choice: 'fp8_e5m2'"),
    (["--trust-remote-code"], "Blink never runs a model's own code"),
])
def test_vllm_flags_blink_lacks_are_refused_with_what_to_do_instead(argv: list[str], message: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        serve_ns(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err
    if "invalid choice" not in message:  # Blink's refusals: one line, not the usage first
        assert err.count("\n") == 1, err


def test_vllm_switches_and_their_no_forms_the_last_given_wins() -> None:
    """As vLLM's: --enable-X after --no-enable-X turns X back on, and the other way round."""
    assert engine_of(["--no-enable-prefix-caching", "--enable-prefix-caching"]).prefix_caching
    assert not engine_of(["--enable-prefix-caching", "--no-enable-prefix-caching"]).prefix_caching
    assert engine_of(["--no-enable-chunked-prefill", "--enable-chunked-prefill"]).chunked_prefill
    assert not engine_of(["--enable-chunked-prefill", "--no-enable-chunked-prefill"]).chunked_prefill
    assert engine_of(["--enable-prefix-caching", "--enable-chunked-prefill"]) == engine_of([])


@pytest.mark.parametrize(("argv", "message"), [
    (["--enable-prefix-caching", "--no-enable-chunked-prefill"], "--enable-prefix-caching needs chunked prefill"),
    (["--seed", "5"], "--seed 5: the seed of --random-weights only; sampling is seeded per request"),
])
def test_vllm_switches_that_would_change_nothing_are_refused(argv: list[str], message: str) -> None:
    """Asked for and not given, before anything starts: prefix caching without chunked prefill (it was silently off),
    a server-wide sampling seed (it only ever seeded random weights). (`blink serve` prints the refusal, exit 2.)"""
    from blink.cli import serve_config

    with pytest.raises(ValueError, match=re.escape(message)):
        serve_config(serve_ns(argv))


def test_the_switches_alone_or_undone_are_served() -> None:
    from blink.vllm_flags import vllm_switch_problem

    for argv in ([], ["--seed", "5", "--random-weights"], ["--seed", "0"], ["--enable-prefix-caching"],
                 ["--enable-prefix-caching", "--no-enable-prefix-caching", "--no-enable-chunked-prefill"]):
        assert vllm_switch_problem(serve_ns(argv)) is None, argv


def test_kv_blocks_and_gpu_memory_utilization_are_not_given_together() -> None:
    """--kv-blocks sized the cache and the fraction was dropped without a word."""
    with pytest.raises(ValueError, match="--kv-blocks 64 sets the KV cache's size and --gpu-memory-utilization"):
        engine_of(["--kv-blocks", "64", "--gpu-memory-utilization", "0.8"])
    assert engine_of(["--kv-blocks", "64"]).kv_blocks == 64


def test_vllm_flags_that_ask_for_nothing_different_are_accepted() -> None:
    assert engine_of(["--tensor-parallel-size", "1", "-pp", "1", "--kv-cache-dtype", "auto"]) == engine_of([])


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3"])
def test_kv_cache_dtype_fp8_is_taken_by_the_gpu_backends_and_refused_on_the_cpu(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's --kv-cache-dtype fp8 (e4m3, as vLLM's fp8): the GPU backends' cache holds float8_e4m3fn, the flag
    passed on to the engine; the CPU backend refuses it naming the backends that take it, before anything starts
    (also under --backend auto on a host whose auto is the CPU)."""
    for backend in ("host", "persistent"):
        cfg = engine_of(["--backend", backend, "--kv-cache-dtype", value])
        assert cfg.fp8_kv_cache and engine_serve.kv_dtype_name(cfg) == "float8_e4m3fn"
        assert cfg.to_argv()[-2:] == ["--kv-cache-dtype", value]
        assert EngineConfig.from_namespace(engine_serve.build_parser().parse_args(cfg.to_argv())) == cfg
    assert not engine_of(["--backend", "host"]).fp8_kv_cache
    assert engine_serve.kv_dtype_name(engine_of(["--backend", "host"])) == "bfloat16"
    with pytest.raises(ValueError, match=f"--kv-cache-dtype {value} runs on the GPU backends"):
        engine_of(["--backend", "cpu", "--kv-cache-dtype", value])
    auto = engine_of(["--kv-cache-dtype", value])
    assert auto.refusal_on("host", None) is None
    assert f"--kv-cache-dtype {value} runs on the GPU backends" in (auto.refusal_on("cpu", None) or "")
    assert main(["serve", "--backend", "cpu", "--kv-cache-dtype", value]) == 2
    assert "the CPU backend's KV cache has its own dtype" in capsys.readouterr().err


def test_every_serve_flag_has_help_and_shows_its_default(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices["serve"]._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        assert action.help, f"{action.option_strings[0]} has no help"
        if action.default not in (None, False, argparse.SUPPRESS) and action.dest != "help":
            assert f"(default: {action.default}" in shown or "(default: " in (action.help or ""), action.dest
    for flag in ("--max-connections", "--header-timeout", "--body-timeout", "--keepalive-timeout"):
        assert flag in shown
    assert "--max-num-seqs N, --max-batch N" in shown


def test_gateway_flags_reach_every_gateway(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    sup = children(["--gateways", "2", "--max-connections", "77", "--header-timeout", "3", "--body-timeout", "4",
                    "--keepalive-timeout", "5", "--served-model-name", "a", "b", "--chat-template", str(template),
                    "--tokenizer", str(tmp_path), "--disable-log-requests"])
    for gw in sup.gateways:
        a = child_args(gw.argv)
        assert (a.max_connections, a.header_timeout, a.body_timeout, a.keepalive_timeout) == (77, 3.0, 4.0, 5.0)
        assert a.served_model_name == ["a", "b"] and a.chat_template == str(template)
        assert a.tokenizer == str(tmp_path) and a.disable_log_requests
    tokenizer = child_args(next(c for c in sup.services if c.name == "tokenizer").argv)
    assert tokenizer.tokenizer == str(tmp_path)


def test_served_names() -> None:
    assert served_names(None, None) == (EMBEDDED_MODEL, ("SmolLM2-135M-Instruct",))
    assert EMBEDDED_MODEL == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert served_names(None, "/m/Qwen2.5-0.5B/") == ("Qwen2.5-0.5B", ())
    assert served_names(["x", "y"], None) == ("x", ("y",))


def test_chat_template_from_a_file_or_inline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat_template_from_arg(str(f)) == f.read_text()
    assert chat_template_from_arg("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ChatTemplateError, match="neither a file nor Jinja"):
        chat_template_from_arg(str(tmp_path / "missing.jinja"))
    assert main(["serve", "--chat-template", "{% for %}"]) == 2
    assert "--chat-template: chat template does not compile" in capsys.readouterr().err
