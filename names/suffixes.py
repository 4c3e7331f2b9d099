"""The Public Suffix List: one lazily parsed copy for the whole process.

The policy (a wildcard never covers or reaches across a public suffix), the
host helpers and the approval message (registered domains, "unrelated") all
ask the same list, so they can never disagree about who owns a name. It
lives here, at the bottom of the layers, because both ``proxy`` and
``approvals`` need it and neither may own it for the other.

The list is the one bundled with ``publicsuffixlist``, ICANN and private
sections both: anyone can register a name under a private-section suffix
(``s3.amazonaws.com``, ``github.io``), so for egressd it is as public as
``com``. Unknown top-level labels count as public suffixes, so
``*.internal`` is refused like ``*.com``.

Every function takes a name already normalised by ``egressd.names.hosts`` (lower
case, A-labels, no trailing dot) and never an IP literal. Pure: no I/O,
except that the bundled list is read once, on first use.
"""

from __future__ import annotations

import functools

from publicsuffixlist import PublicSuffixList

__all__ = ["is_public_suffix", "public_suffix", "registrable_domain", "suffix_beneath"]


@functools.cache
def _list() -> PublicSuffixList:
    return PublicSuffixList()


def public_suffix(name: str) -> str | None:
    """The longest public suffix a name ends with (``s3.amazonaws.com`` for ``b.s3.amazonaws.com``).

    A name that is itself a public suffix is its own; None when the list
    cannot place the name at all.
    """
    suffix: str | None = _list().publicsuffix(name)
    return suffix


def registrable_domain(name: str) -> str | None:
    """The registrable domain (eTLD+1) of a name; None for a public suffix itself."""
    domain: str | None = _list().privatesuffix(name)
    return domain


def is_public_suffix(name: str) -> bool:
    """Whether a name is itself a public suffix (``com``, ``co.uk``, ``github.io``)."""
    return bool(_list().is_public(name))


def suffix_beneath(name: str, base: str) -> str | None:
    """The public suffix between ``base`` and ``name``, if one lies there; else None.

    ``name`` is ``base`` or below it. For ``*.amazonaws.com`` and
    ``bucket.s3.amazonaws.com`` it is ``s3.amazonaws.com``: the name belongs
    to whoever registered ``bucket``, not to the owner of the base. None
    when the name's registrable domain is the base or above it.
    """
    suffix = public_suffix(name)
    if suffix is None:
        return name  # the list could not place the name: fail closed, as if a suffix were there
    if suffix == base or suffix.endswith("." + base):
        return suffix
    return None
