"""Build hook for the one C extension: the ring's atomics (CAS, acquire/release, fences)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shared._atomics", ["shared/_atomics.c"], extra_compile_args=["-O2"])])
