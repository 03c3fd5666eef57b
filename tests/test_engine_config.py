"""The one engine config: the engine's parser, ``blink serve``'s engine flags and the supervisor's engine
command all come from ``EngineConfig``, agree on defaults and round-trip; ``Env`` is every BLINK_* variable."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from blink.cli import build_parser, main
from blink.supervisor import ServeConfig, Supervisor
from gpu_engine import serve as engine_serve
from gpu_engine.gpu import sched_structs
from shared.config import DERIVED_DEFAULTS, PERSISTENT_MAX_BATCH, EngineConfig, engine_flags
from shared.env import Env, default_run_dir, env
from shared.ring import RingGeometry

ROOT = Path(__file__).resolve().parent.parent


def options(ap: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: action for action in ap._actions for opt in action.option_strings}


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_every_field_is_a_flag_of_the_engine_and_of_serve_with_its_help(monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    names = {fl.name for fl in engine_flags()}
    fields = {f.name for f in EngineConfig.__dataclass_fields__.values() if f.name != "geometry"}
    assert names == fields | set(RingGeometry.__dataclass_fields__)
    monkeypatch.setenv("COLUMNS", "400")  # no wrapping inside a help text
    for argv in (["serve", "--help"], ["engine", "--help"]):
        parsers = {"serve": serve_parser(), "engine": engine_serve.build_parser()}
        with pytest.raises(SystemExit):
            main(argv) if argv[0] == "serve" else engine_serve.build_parser().parse_args(argv[1:])
        shown = one_line(capsys.readouterr().out)
        found = options(parsers[argv[0]])
        for fl in engine_flags():
            assert fl.flag in found, f"{fl.flag} missing from {argv[0]}"
            parsed_default = None if fl.name in DERIVED_DEFAULTS else fl.default  # derived in from_namespace
            assert found[fl.flag].dest == fl.name and found[fl.flag].default == parsed_default
            assert one_line(fl.help) in shown, f"{fl.flag}: help text missing from {argv[0]} --help"
            if fl.name in DERIVED_DEFAULTS:
                assert one_line(f"{fl.help} (default: {DERIVED_DEFAULTS[fl.name]})") in shown
            elif "(default:" in fl.help:
                continue
            elif fl.default is not None and not isinstance(fl.default, bool):
                assert one_line(f"{fl.help} (default: {fl.default})") in shown


def test_defaults_agree() -> None:
    engine = engine_serve.parse_args([])
    served = EngineConfig.from_namespace(build_parser().parse_args(["serve"]))
    assert engine == served == EngineConfig()
    assert engine.geometry == RingGeometry()
    assert engine.geometry.max_output_tokens == 2048
    assert engine.ring_name == env().ring_name
    assert Env().run_dir == Env.from_environ({}).run_dir == default_run_dir()
    assert build_parser().parse_args(["serve"]).run_dir == env().run_dir


def served_engine_argv(argv: list[str]) -> tuple[EngineConfig, list[str]]:
    """What ``blink serve ARGV`` configures, and the engine command line its supervisor runs."""
    ns = build_parser().parse_args(["serve", *argv])
    cfg = EngineConfig.from_namespace(ns)
    child = Supervisor(ServeConfig.from_args(ns, cfg)).engine.argv
    assert child[:3] == [sys.executable, "-m", "gpu_engine.serve"]
    return cfg, child[3:]


@pytest.mark.parametrize("argv", [
    [],
    ["--ring", "r-1", "--backend", "persistent", "--dtype", "bfloat16", "--random-weights", "--num-slots", "32",
     "--max-prompt-tokens", "100", "--max-output-tokens", "7", "--top-logprobs", "0", "--block-size", "8",
     "--kv-blocks", "99", "--max-batch", "3", "--seed", "5", "--threads", "2", "--kernel-plan", "h200"],
    ["--model", str(ROOT / "README.md"), "--max-batch", "64", "--port", "9001", "--gateways", "2"],
    ["--backend", "host", "--kernel-plan", "cublas"],
])
def test_the_supervisors_engine_command_parses_back_to_the_same_config(argv: list[str]) -> None:
    cfg, child = served_engine_argv(argv)
    assert engine_serve.parse_args(child) == cfg
    assert EngineConfig.from_namespace(engine_serve.build_parser().parse_args(cfg.to_argv())) == cfg


def test_the_engine_gets_only_flags_that_differ_from_its_defaults() -> None:
    _, child = served_engine_argv(["--ring", "r-2", "--num-slots", "256", "--max-batch", "8", "--port", "9"])
    assert child == ["--ring", "r-2", "--max-num-seqs", "8"]  # --ring always: its default is the environment's


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-batch", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--kv-blocks", "-1"], "--kv-blocks must be >= 0, got -1"),
    (["--model", "/no/such/model"], "--model: path /no/such/model does not exist"),
    (["--top-logprobs", "21"], "top_logprobs must be in 0..20"),
    (["--ring", ""], "--ring must not be empty"),
    (["--backend", "persistent", "--max-num-seqs", "1025"],
     "--max-num-seqs 1025: the persistent backend serves at most 1024 sequences at once"),
    (["--backend", "cpu", "--kernel-plan", "h200"],
     "--kernel-plan h200 applies to the GPU backends (got --backend cpu)"),
])
def test_bad_values_are_refused_by_the_engine_and_by_serve(argv: list[str], message: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        engine_serve.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_persistent_backend_s_batch_limit_is_the_scheduler_s() -> None:
    """--max-num-seqs up to the scheduler's BLINK_MAX_BATCH runs on the persistent backend; past it the engine
    refuses it, also once --backend auto resolved to persistent; the other backends have no such limit."""
    assert PERSISTENT_MAX_BATCH == sched_structs.MAX_BATCH == 1024
    assert EngineConfig(backend="persistent", max_batch=1024).max_batch == 1024
    assert EngineConfig(backend="host", max_batch=2048).max_batch == 2048
    auto = EngineConfig(max_batch=1025)
    assert auto.refusal_on("host", None) is None
    assert "serves at most 1024 sequences" in (auto.refusal_on("persistent", None) or "")


def test_bad_choices_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        engine_serve.parse_args(["--backend", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--dtype must be one of auto, float16, half, bfloat16, float32"):
        EngineConfig(dtype="float8")


def test_env_reads_every_variable_typed() -> None:
    e = Env.from_environ({"BLINK_RUN_DIR": "/x/run", "BLINK_LOG_LEVEL": "DEBUG", "BLINK_LOG_JSON": "0",
                          "BLINK_HEARTBEAT_TIMEOUT_S": "7.5", "BLINK_SCHED_FULL_SCAN": "yes", "BLINK_API_KEY": "",
                          "BLINK_CUDA_BUILD_DIR": "/b", "BLINK_TOKENIZER_ASSETS": "/t"})
    assert (e.run_dir, e.log_level, e.log_json, e.heartbeat_timeout_s) == (Path("/x/run"), "debug", False, 7.5)
    assert e.sched_full_scan and e.api_key is None
    assert (e.cuda_build_dir, e.tokenizer_assets) == (Path("/b"), Path("/t"))
    with pytest.raises(SystemExit, match="BLINK_SCHED_YIELD_ALL"):
        Env.from_environ({"BLINK_SCHED_YIELD_ALL": "maybe"})
    with pytest.raises(SystemExit, match="BLINK_HEARTBEAT_TIMEOUT_S"):
        Env.from_environ({"BLINK_HEARTBEAT_TIMEOUT_S": "soon"})


def test_the_device_switches_are_on_unless_set_to_0() -> None:
    """The persistent backend's device processors and prefix cache are on by default; 0 turns each off."""
    on = Env.from_environ({})
    assert on.device_processors and on.device_prefix_cache
    off = Env.from_environ({"BLINK_DEVICE_PROCESSORS": "0", "BLINK_DEVICE_PREFIX_CACHE": "off"})
    assert not off.device_processors and not off.device_prefix_cache


def test_the_readme_lists_every_variable() -> None:
    readme = (ROOT / "README.md").read_text()
    for var in Env.variables():
        assert f"| `{var}` |" in readme, f"{var} is not in the README's table"


def test_no_product_module_reads_blink_variables_itself() -> None:
    offenders = []
    for package in ("blink", "shared", "gpu_engine", "dpu_gateway", "dpu_tokenizer", "schema"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            if path != ROOT / "shared" / "env.py" and ('environ.get("BLINK_' in text or 'getenv("BLINK_' in text
                                                       or 'environ["BLINK_' in text):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def test_the_kernel_plan_is_a_flag_auto_by_default_not_a_variable(capsys: pytest.CaptureFixture[str]) -> None:
    """--kernel-plan (auto unset: the plan measured on the engine's GPU) is a flag of the engine and of `blink serve`
    that the supervisor passes on only where it is not auto; an unknown plan is refused by the parser; no BLINK_*
    variable picks kernels any more."""
    assert EngineConfig().kernel_plan == engine_serve.parse_args([]).kernel_plan == "auto"
    assert engine_serve.parse_args(["--kernel-plan", "cublas"]).kernel_plan == "cublas"
    _, child = served_engine_argv(["--ring", "r-3", "--kernel-plan", "h200"])
    # under --backend auto the supervisor also passes the batch it derived (the engine could see another host)
    assert child == ["--ring", "r-3", "--kernel-plan", "h200", "--max-num-seqs", str(EngineConfig().max_batch)]
    assert "--kernel-plan" not in served_engine_argv(["--ring", "r-3"])[1]
    with pytest.raises(SystemExit):
        engine_serve.parse_args(["--kernel-plan", "fastest"])
    assert "invalid choice: 'fastest'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--kernel-plan", "h200_wide"])
    assert "invalid choice: 'h200_wide'" in capsys.readouterr().err
    assert not {v for v in Env.variables() if v.startswith(("BLINK_TILED", "BLINK_PDL", "BLINK_SKINNY",
                                                             "BLINK_ONE_LAUNCH", "BLINK_DECODE_"))}


@pytest.mark.parametrize("flags, named", [
    ([], []),
    (["--max-num-seqs", "8"], ["--max-num-seqs"]),
    (["--max-batch", "256"], ["--max-num-seqs"]),  # a GPU's default value, given: still given
    (["--dtype", "float16", "--num-slots", "64"], ["--dtype", "--num-slots"]),
    (["--dtype", "auto"], []),  # the default's own value
])
def test_frontend_only_refuses_the_engine_flags_given_and_only_them(flags: list[str], named: list[str]) -> None:
    from blink.cli import frontend_config

    args = build_parser().parse_args(["serve", "--frontend-only", "--ring", "blink-test-given", *flags])
    if not named:
        try:
            frontend_config(args)
        except ValueError as exc:  # a later check (the tokenizer's files) may refuse, never the engine flags
            assert "would not apply" not in str(exc)
        return
    with pytest.raises(ValueError, match="would not apply") as err:
        frontend_config(args)
    assert str(err.value).startswith("--frontend-only starts no engine: " + ", ".join(named) + " would not apply")
