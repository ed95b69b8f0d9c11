"""Errors for bad user input to the storage layer.

A :class:`DataError` message is one line that starts with the config key or file it is about
(``data.files: no file matches '/x/*.txt'``), so the CLI can print it as is and exit 2 (docs/DESIGN.md §8).
It is a :class:`bcdflow.errors.BadInput` (a ``ValueError``), so pydantic validators and callers that
catch ``ValueError`` treat it as bad input rather than a crash. Damaged objects in the store raise
the storage modules' own :class:`bcdflow.errors.DamagedArtifact` subclasses instead.
"""
from __future__ import annotations

from bcdflow.errors import BadInput


class DataError(BadInput):
    """Bad data configuration or unreadable input; the message names the key or file."""
