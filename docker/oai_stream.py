"""One streamed completion and one streamed chat completion through the official ``openai`` client:
    python docker/oai_stream.py [--url http://127.0.0.1:8000/v1]
Prints the number of chunks and the text of each; exits 1 if either stream came back empty.
"""

from __future__ import annotations

import argparse
import sys

import openai

MODEL = "SmolLM2-135M-Instruct"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    client = openai.OpenAI(base_url=args.url, api_key="unused", max_retries=5)
    stream = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=args.max_tokens,
                                       temperature=0, stream=True)
    parts = [c.choices[0].text for c in stream if c.choices]
    print(f"completions: {len(parts)} chunks: {''.join(parts)!r}")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=args.max_tokens, temperature=0, stream=True)
    deltas = [c.choices[0].delta.content or "" for c in chat if c.choices]
    print(f"chat: {len(deltas)} chunks: {''.join(deltas)!r}")
    return 0 if "".join(parts) and "".join(deltas) else 1


if __name__ == "__main__":
    sys.exit(main())
