"""Build hook for the C extensions: the ring's atomics, the tokenizer's byte-level BPE encoder, and the CPU
engine's quantized-weight matmuls."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("shared._atomics", ["shared/_atomics.c"], extra_compile_args=["-O2"]),
        Extension("dpu_tokenizer._fastbpe", ["dpu_tokenizer/_fastbpe.c"], extra_compile_args=["-O2"]),
        Extension("gpu_engine.kernels._cpu_quant", ["gpu_engine/kernels/_cpu_quant.c"],
                  extra_compile_args=["-O3", "-ffp-contract=off"]),
    ]
)
