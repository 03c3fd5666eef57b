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
        parser.error(f"{shown}: {r.instead}")


# vLLM switches that turn on what Blink does by default: accepted, and they change nothing.
DEFAULT_ON = (
    ("--enable-chunked-prefill", "chunked prefill is on by default (--no-enable-chunked-prefill turns it off)"),
    ("--enable-prefix-caching", "prefix caching is on by default on the cpu and host backends "
     "(--no-enable-prefix-caching turns it off; the persistent backend runs without it)"),
)


def add_refused_flags(ap: argparse.ArgumentParser) -> None:
    """vLLM's flags that Blink lacks, in a help group of their own; its switches for Blink's defaults."""
    for name, what in DEFAULT_ON:
        ap.add_argument(name, action="store_true", dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                        help=f"accepted: {what}")
    group = ap.add_argument_group("vLLM flags Blink does not take (each refused with what to do instead)")
    for r in REFUSED:
        accepted = f" (accepted: {r.harmless})" if r.harmless is not None else ""
        group.add_argument(*r.names, action=RefuseAction, refused=r, dest=argparse.SUPPRESS,
                           default=argparse.SUPPRESS, metavar="X" if r.takes_value else None,
                           help=f"refused: {r.instead}{accepted}")
