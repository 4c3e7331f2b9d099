"""Which audit line egressd writes with: the compiled one (``egressd_native``, Rust) or the Python one.

``egressd_native`` is an optional, separately built package (``native/``;
``scripts/install.sh`` builds it where ``cargo`` is). It is used when it is
installed, speaks the interface this egressd was written against, and
``EGRESSD_NATIVE`` does not turn it off (``0``, ``off``, ``no`` or ``false``:
the Python path, for a comparison or a suspected fault). Either way the lines
are the same bytes: the Python module is the reference, and the tests feed
both the same records. ``DESCRIPTION`` is what ``egressd serve``'s start-up
line and ``egressd doctor`` say.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["DESCRIPTION", "ENV", "INTERFACE", "MODULE", "TURNED_OFF"]

ENV = "EGRESSD_NATIVE"
# egressd_native.INTERFACE this code was written against; a build of another is not used.
INTERFACE = 1
_OFF = ("0", "off", "no", "false")


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get(ENV, "").strip().lower() in _OFF:
        return None, f"Python ({ENV}={os.environ[ENV]})"
    try:
        import egressd_native
    except ImportError:
        return None, "Python (egressd_native is not installed: scripts/install.sh builds it where cargo is)"
    found = getattr(egressd_native, "INTERFACE", None)
    if found != INTERFACE:
        return None, f"Python (egressd_native speaks interface {found!r}, this egressd {INTERFACE}: rebuild it)"
    return egressd_native, f"compiled (egressd_native {egressd_native.__version__})"


MODULE, DESCRIPTION = _load()
# Whether ``EGRESSD_NATIVE`` turned the compiled line off (as opposed to its not being there).
TURNED_OFF = os.environ.get(ENV, "").strip().lower() in _OFF
