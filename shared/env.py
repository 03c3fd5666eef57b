"""Every environment variable Blink reads, typed, in one place; read once at start-up.

Each field of ``Env`` names its variable, how its text is parsed and what it means; an unset or empty
variable keeps the field's default. No other product module reads a ``BLINK_*`` variable.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def default_run_dir() -> Path:
    """Where the services' Unix sockets live unless BLINK_RUN_DIR or --run-dir says otherwise:
    ``$XDG_RUNTIME_DIR/blink`` when that folder is this user's and closed to others, else ``/tmp/blink-UID``.
    Either way the services create it with mode 0700 and refuse it when it is not private
    (``shared.ipc.run_dir_problem``): a name in /tmp can be guessed and taken by another user."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        try:
            st = os.stat(xdg)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return Path(xdg) / "blink"
    return Path(f"/tmp/blink-{os.geteuid()}")


# The one default of BLINK_HEARTBEAT_TIMEOUT_S, which every service's config and the container probe take:
# far above the longest silence of a live CPU engine measured beside a co-tenant that loads both cores
# (bench/beat_gaps.py; RELIABILITY.md, "False outages"), so a busy host makes Blink slower, never down.
HEARTBEAT_TIMEOUT_S = 10.0


def _var(name: str, default: Any, meaning: str, parse: Callable[[str], Any] = str,
         factory: Callable[[], Any] | None = None) -> Any:
    meta = {"var": name, "parse": parse, "help": meaning}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True, slots=True)
class Env:
    """Values from the environment. Names and meanings are also listed in the README."""

    log_level: str = _var("BLINK_LOG_LEVEL", "info", "log level of every process", str.lower)
    log_json: bool | None = _var("BLINK_LOG_JSON", None, "force JSON logs on or off "
                                 "(default: JSON when stderr is not a terminal)", _bool)
    run_dir: Path = _var("BLINK_RUN_DIR", None, "Unix sockets of the services", Path, factory=default_run_dir)
    ring_name: str = _var("BLINK_RING_NAME", "blink-ring", "shared-memory segment name")
    api_key: str | None = _var("BLINK_API_KEY", None, "same as --api-key")
    heartbeat_timeout_s: float = _var("BLINK_HEARTBEAT_TIMEOUT_S", HEARTBEAT_TIMEOUT_S,
                                      "engine considered down (its streams failed, new requests refused, and "
                                      "blink serve replacing it as hung) after this much heartbeat silence, on "
                                      "each observer's own clock (RELIABILITY.md, 'False outages')", float)
    sched_yield_all: bool = _var("BLINK_SCHED_YIELD_ALL", False,
                                 "the persistent scheduler leaves its SM every step", _bool)
    sched_plain_claim: bool = _var("BLINK_SCHED_PLAIN_CLAIM", False,
                                   "claim slots by a store, not a PCIe compare-and-swap", _bool)
    sched_full_scan: bool = _var("BLINK_SCHED_FULL_SCAN", False,
                                 "read every slot's state word at each doorbell", _bool)
    step_timeout_s: float = _var("BLINK_STEP_TIMEOUT_S", 5.0, "a GPU step not complete after this long is a device "
                                 "hang: the engine fails its requests with ENGINE_FAILURE and exits", float)
    fault: str = _var("BLINK_FAULT", "", "debug: faults the engine injects, KIND@STEP[,KIND@STEP...], KIND hang "
                      "or launch (gpu_engine/faults.py)")
    fault_once_dir: Path | None = _var("BLINK_FAULT_ONCE_DIR", None, "debug: each BLINK_FAULT entry fires once "
                                       "per folder (an engine arms the first one whose marker it creates)", Path)
    cuda_build_dir: Path | None = _var("BLINK_CUDA_BUILD_DIR", None,
                                       "where the scheduler library is built (default: gpu_engine/csrc/build)", Path)
    metrics_dir: Path | None = _var("PROMETHEUS_MULTIPROC_DIR", None, "folder where every gateway's metrics are "
                                    "summed (blink serve sets it to RUN_DIR/metrics)", Path)
    device_processors: bool = _var("BLINK_DEVICE_PROCESSORS", True, "the persistent scheduler applies the "
                                   "penalties, logit_bias, min_tokens and grammars on the device (0: left out of its "
                                   "graphs, and those fields refused with a 400 on that backend)", _bool)
    device_prompt_logprobs: bool = _var("BLINK_DEVICE_PROMPT_LOGPROBS", True, "the persistent scheduler computes "
                                        "prompt log-probs through a score graph (0: no score graph, and "
                                        "prompt_logprobs and echo with logprobs refused with a 400 on that backend)",
                                        _bool)
    device_prefix_cache: bool = _var("BLINK_DEVICE_PREFIX_CACHE", True, "the persistent scheduler caches prefixes "
                                     "on the device where the policy does (0: not on that backend, whatever "
                                     "--enable-prefix-caching says)", _bool)
    rank_plan_cache: bool = _var("BLINK_RANK_PLAN_CACHE", True, "keep the tokenizer's checked rank plans in "
                                 "$XDG_CACHE_HOME/blink/rank-plans (0: check the merges at every start)", _bool)
    cpu_weights_dir: Path | None = _var("BLINK_CPU_WEIGHTS_DIR", None, "the CPU backend keeps its loaded weights "
                                        "in a file there that every engine loading them the same way maps (the "
                                        "live and the standby engine: held once, not on huge pages; unset: each "
                                        "engine its own copy)", Path)
    rdma_nic: str = _var("BLINK_RDMA_NIC", "", "the RDMA verbs layer, MODULE:NAME (default: pyverbs on a real "
                         "device); the tests name harness.rdma_standin:SharedMemoryNic, a stand-in for the NIC that "
                         "works on one host without a device (docs/RDMA.md)")
    rdma_secret_file: Path | None = _var("BLINK_RDMA_SECRET_FILE", None, "a file both sides of an RDMA ring read "
                                         "(at least 16 bytes, readable by its owner only, owned by the user that "
                                         "reads it or root): the endpoint exchange "
                                         "is then signed both ways with it and an unsigned peer refused "
                                         "(docs/RDMA.md); unset: the exchange is open", Path)
    tokenizer_assets: Path = _var("BLINK_TOKENIZER_ASSETS", None, "tokenizer files of other model families "
                                  "for the tests", Path, factory=lambda: Path.home() / ".cache/blink/tokenizer-assets")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Env:
        e = os.environ if environ is None else environ
        given: dict[str, Any] = {}
        try:
            for f in dataclasses.fields(cls):
                raw = e.get(f.metadata["var"], "")
                if raw != "":
                    given[f.name] = f.metadata["parse"](raw)
        except ValueError as exc:
            raise SystemExit(f"bad environment variable {f.metadata['var']}: {exc}") from None
        return cls(**given)

    @staticmethod
    def variables() -> dict[str, str]:
        """Every variable read, with its meaning."""
        return {f.metadata["var"]: f.metadata["help"] for f in dataclasses.fields(Env)}


_ENV: Env | None = None


def env() -> Env:
    """The process's environment, read on first use and frozen afterwards."""
    global _ENV
    if _ENV is None:
        _ENV = Env.from_environ()
    return _ENV
