"""Named allowlists for common toolchains (``--preset python``).

Each preset is a short tuple of allowlist entries, in the syntax
``egressd.proxy.core.policy.parse_entry`` accepts (tests check that every entry parses).
They name exact hosts rather than wildcards where the vendor's file hosts
share a public suffix (``githubusercontent.com`` is one), so a preset never
opens more than its toolchain needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["PRESETS", "UnknownPreset", "preset_entries"]

PRESETS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        # pip: the index, and the CDN that serves the distribution files.
        "python": ("pypi.org", "files.pythonhosted.org"),
        "node": ("registry.npmjs.org",),
        "yarn": ("registry.yarnpkg.com", "repo.yarnpkg.com"),
        # git over HTTPS, the REST API, archives, raw files and release assets.
        "github": (
            "github.com",
            "api.github.com",
            "codeload.github.com",
            "raw.githubusercontent.com",
            "objects.githubusercontent.com",
            "release-assets.githubusercontent.com",
        ),
        # apt uses plain HTTP (port 80) by default; both ports are included.
        "debian": ("deb.debian.org", "security.debian.org"),
        "ubuntu": ("archive.ubuntu.com", "security.ubuntu.com", "ports.ubuntu.com"),
        "alpine": ("dl-cdn.alpinelinux.org",),
        # cargo: the sparse index, the API and the crate downloads.
        "rust": ("crates.io", "index.crates.io", "static.crates.io"),
        # go: the module proxy and the checksum database.
        "go": ("proxy.golang.org", "sum.golang.org"),
    }
)


class UnknownPreset(KeyError, ValueError):
    """No preset has the requested name; the message lists the known ones."""

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; show the message as is.
        return str(self.args[0]) if self.args else ""


def preset_entries(name: str) -> tuple[str, ...]:
    """Return the entries of a preset; raises UnknownPreset for an unknown name."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise UnknownPreset(f"unknown preset {name!r}; known presets: {known}") from None
