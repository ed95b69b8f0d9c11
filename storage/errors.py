"""Errors for bad user input to the storage layer.

A :class:`DataError` message is one line that starts with the config key or file it is about
(``data.files: no file matches '/x/*.txt'``), so the CLI can print it as is and exit non-zero
(DESIGN §8). It subclasses ``ValueError`` so pydantic validators and callers that catch
``ValueError`` treat it as bad input rather than a crash.
"""
from __future__ import annotations


class DataError(ValueError):
    """Bad data configuration or unreadable input; the message names the key or file."""
