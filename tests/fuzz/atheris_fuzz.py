"""The fuzz targets under atheris (libFuzzer), when it is installed.

    python -m tests.fuzz.atheris_fuzz TARGET [libFuzzer flags, e.g. -max_total_time=600 CORPUS_DIR]

The checks are ``tests.fuzz.fuzz_parsers``'s, so the oracles are the same;
libFuzzer brings its own coverage (the target modules are instrumented) and
comparison tracing. Without a corpus directory the seeds are written to a
temporary one. A failure is a FuzzFailure, which libFuzzer reports as a crash
and saves as ``crash-*``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["proxy"]):
    from tests.fuzz.fuzz_parsers import TARGETS


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: python -m tests.fuzz.atheris_fuzz {{{','.join(sorted(TARGETS))}}} [libFuzzer flags]")
    target = TARGETS[argv[1]]
    flags = argv[2:]
    if not any(not flag.startswith("-") for flag in flags):
        corpus = Path(tempfile.mkdtemp(prefix=f"fuzz-{target.name}-"))
        for i, seed in enumerate(target.seeds()):
            (corpus / f"seed-{i}").write_bytes(seed)
        flags.append(str(corpus))
    if target.reset is not None:
        target.reset()
    atheris.Setup([argv[0], *flags], target.check)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
