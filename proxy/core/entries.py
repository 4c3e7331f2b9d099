"""Entries compared: what an entry matches (``entry_key``), and what a change of entries added and removed.

A reload (``egressd serve`` on SIGHUP) and a ``PATCH /runs/ID`` say what
they changed in these terms; ``Run.reconfigure`` says what became of a
run's live edits (``LiveMerge``). Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from egressd.proxy.core.policy import Entry


def entry_key(entry: Entry) -> tuple[object, ...]:
    """What an entry matches, without its spelling: two entries with one key allow or deny the same."""
    return (entry.host, entry.wildcard, entry.ports, entry.address)


@dataclass(frozen=True, slots=True)
class EntryChange:
    """Entries added and removed, as their texts (a reload's or a ``PATCH /runs/ID``'s)."""

    allow_added: tuple[str, ...] = ()
    allow_removed: tuple[str, ...] = ()
    deny_added: tuple[str, ...] = ()
    deny_removed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.allow_added or self.allow_removed or self.deny_added or self.deny_removed)

    @property
    def added(self) -> dict[str, list[str]]:
        return {"allow": list(self.allow_added), "deny": list(self.deny_added)}

    @property
    def removed(self) -> dict[str, list[str]]:
        return {"allow": list(self.allow_removed), "deny": list(self.deny_removed)}

    @property
    def by_kind(self) -> dict[str, dict[str, list[str]]]:
        """``{"allow": {"added": [...], "removed": [...]}, "deny": {...}}``."""
        return {
            "allow": {"added": list(self.allow_added), "removed": list(self.allow_removed)},
            "deny": {"added": list(self.deny_added), "removed": list(self.deny_removed)},
        }


@dataclass(frozen=True, slots=True)
class LiveMerge:
    """What ``Run.reconfigure`` did with the run's live edits (control-API edits), as their texts.

    ``kept``: the edits still laid on top of the configured entries (the files
    do not say them). ``in_files``: the edits the configured entries now say
    themselves (an added entry the files have, a removed one they no longer
    have); the files rule those from now on, so taking one out of a file
    takes effect at the next reload.
    """

    kept: EntryChange = EntryChange()
    in_files: EntryChange = EntryChange()


def entry_diff(old: Sequence[Entry], new: Sequence[Entry]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(added, removed): the texts of ``new``'s entries no entry of ``old`` matches as, and the reverse."""
    old_keys = {entry_key(e) for e in old}
    new_keys = {entry_key(e) for e in new}
    added = tuple(dict.fromkeys(e.text for e in new if entry_key(e) not in old_keys))
    removed = tuple(dict.fromkeys(e.text for e in old if entry_key(e) not in new_keys))
    return added, removed
