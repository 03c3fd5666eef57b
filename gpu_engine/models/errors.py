"""Errors raised while reading a model's configuration or weights."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be loaded; the message names the file and the problem."""
