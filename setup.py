"""Build hook for the C extensions: the ring's atomics, and the tokenizer's byte-level BPE encoder."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("shared._atomics", ["shared/_atomics.c"], extra_compile_args=["-O2"]),
        Extension("dpu_tokenizer._fastbpe", ["dpu_tokenizer/_fastbpe.c"], extra_compile_args=["-O2"]),
    ]
)
