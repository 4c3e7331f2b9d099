"""Untrusted text made safe to show.

Pure: no I/O.
"""

from __future__ import annotations

__all__ = ["quoted"]


def quoted(text: str, limit: int = 80) -> str:
    """Untrusted text for an error message: Python's quoted, escaped form, cut after ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
