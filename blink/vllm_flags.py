"""``vllm serve`` flags that Blink does not have: each is refused with what Blink does instead.

A flag whose value means "nothing different" (``--tensor-parallel-size 1``) is accepted, so that a
vLLM command line that asks for nothing Blink lacks runs unchanged; any other value, or a bare switch,
ends ``blink serve`` with a usage error naming the flag and the alternative.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class Refused:
    names: tuple[str, ...]      # the flag and its short forms
    instead: str                # what Blink does instead
    harmless: str | None = None  # a value that asks for nothing (accepted); None: a switch, always refused
    takes_value: bool = True


REFUSED = (
    Refused(("--tensor-parallel-size", "-tp"), "tensor parallelism is not supported; Blink runs one engine "
            "per GPU: see --data-parallel-size", "1"),
    Refused(("--pipeline-parallel-size", "-pp"), "pipeline parallelism is not supported; Blink runs one "
            "engine per GPU", "1"),
    Refused(("--enable-lora", "--lora-modules"), "LoRA adapters are not supported", takes_value=False),
    Refused(("--speculative-config",), "speculative decoding is not supported"),
    Refused(("--enforce-eager",), "the GPU backends always replay captured graphs (the CPU backend has "
            "none): pick --backend cpu|host|persistent", takes_value=False),
    Refused(("--trust-remote-code",), "Blink never runs a model's own code; it serves its built-in "
            "architectures: drop the flag", takes_value=False),
    Refused(("--load-format",), "Blink loads what the model's files are: safetensors (a Hugging Face folder or "
            "Hub repo) or GGUF (a .gguf file, or --gguf-file of a Hub repo)", "auto"),
    Refused(("--max-logprobs",), "alternatives per token are set by --top-logprobs (0..20)"),
    Refused(("--swap-space", "--cpu-offload-gb"), "the KV cache lives on the engine's device only; size it "
            "with --kv-blocks or --gpu-memory-utilization"),
    Refused(("--ssl-keyfile", "--ssl-certfile"), "the gateway speaks plain HTTP; put a TLS proxy in front"),
    Refused(("--distributed-executor-backend",), "Blink runs one engine process; there is no executor to pick"),
)


class RefuseAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, refused: Refused, **kwargs: Any) -> None:
        self.refused = refused
        super().__init__(option_strings, dest, nargs=None if refused.takes_value else 0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        r = self.refused
        if r.harmless is not None and values == r.harmless:
            return
        shown = option_string if not r.takes_value else f"{option_string} {values}"
        parser.exit(2, f"{parser.prog}: error: {shown}: {r.instead}\n")  # one line, without the 40-line usage


# vLLM switches that turn on what Blink does by default, each the opposite of a --no-... flag: as in vLLM, the
# last of the two given wins. (flag, the --no-... flag's dest, what it asks for)
DEFAULT_ON = (
    ("--enable-chunked-prefill", "no_enable_chunked_prefill",
     "chunked prefill, on by default (--no-enable-chunked-prefill turns it off)"),
    ("--enable-prefix-caching", "no_enable_prefix_caching",
     "prefix caching, on by default on every backend (--no-enable-prefix-caching turns it off); it needs chunked "
     "prefill"),
)
ASKED_PREFIX_CACHING = "asked_prefix_caching"  # the namespace's note that --enable-prefix-caching was given


class EnableAction(argparse.Action):
    """``--enable-X``: clears its ``--no-enable-X`` flag's dest (the later of the two wins) and notes it was given."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, False)
        if option_string == "--enable-prefix-caching":
            setattr(namespace, ASKED_PREFIX_CACHING, True)


def vllm_switch_problem(ns: argparse.Namespace) -> str | None:
    """What ``blink serve`` refuses of the vLLM switches once all are parsed: prefix caching asked for without chunked
    prefill (here it works within chunked prefill's policy), and --seed without --random-weights (sampling is seeded
    per request, by its ``seed`` field or its own draw; --seed only seeds random weights)."""
    if (getattr(ns, ASKED_PREFIX_CACHING, False) and not getattr(ns, "no_enable_prefix_caching", False)
            and getattr(ns, "no_enable_chunked_prefill", False)):
        return ("--enable-prefix-caching needs chunked prefill, which --no-enable-chunked-prefill turns off: give one "
                "of the two")
    if getattr(ns, "seed", 0) and not getattr(ns, "random_weights", False):
        return (f"--seed {ns.seed}: the seed of --random-weights only; sampling is seeded per request (a request's "
                "seed field, else a seed of its own), so a server-wide seed would change nothing")
    return None


def add_refused_flags(ap: argparse.ArgumentParser) -> None:
    """vLLM's flags that Blink lacks, in a help group of their own; its switches for Blink's defaults."""
    for name, dest, what in DEFAULT_ON:
        ap.add_argument(name, action=EnableAction, dest=dest, default=argparse.SUPPRESS, help=f"vLLM's: {what}")
    group = ap.add_argument_group("vLLM flags Blink does not take (each refused with what to do instead)")
    for r in REFUSED:
        accepted = f" (accepted: {r.harmless})" if r.harmless is not None else ""
        group.add_argument(*r.names, action=RefuseAction, refused=r, dest=argparse.SUPPRESS,
                           default=argparse.SUPPRESS, metavar="X" if r.takes_value else None,
                           help=f"refused: {r.instead}{accepted}")
