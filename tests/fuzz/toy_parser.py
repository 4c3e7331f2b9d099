"""A toy parser with a bug behind a five-byte condition, to show the fuzzer is coverage-guided.

Blind mutation of the seed must hit five chosen bytes at once (about one
chance in 2**40 per input); a coverage-guided loop keeps every input that
gets one comparison further and so needs only a few thousand inputs.
"""

from __future__ import annotations


class ToyError(ValueError):
    """The documented error: not a toy record."""


def parse_toy(data: bytes) -> int:
    """The payload byte of an 8-byte record starting with ``T``; a planted IndexError for ``TFUZZ!``."""
    if len(data) < 8 or data[0] != 0x54:
        raise ToyError("not a toy record")
    if data[1] == 0x46:
        if data[2] == 0x55:
            if data[3] == 0x5A:
                if data[4] == 0x5A:
                    if data[5] == 0x21:
                        return data[64]  # the planted bug: an IndexError, not a ToyError
    return data[7]
