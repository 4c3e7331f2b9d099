"""The fleet's schema, as versioned migrations applied in order by ``egressd state migrate`` (never by serve).

Each migration is applied once, in one transaction with its row in
``egressd_schema``; a database is at the version of its highest row. An
egressd serves only a database at exactly ``LATEST``: an older one needs
``egressd state migrate``, a newer one a newer egressd. A migration, once
released, is never edited: a change is a new one.
"""

from __future__ import annotations

from dataclasses import dataclass

# Made before the first migration, by the migrator: where the versions are kept.
BOOKKEEPING = """
CREATE TABLE IF NOT EXISTS egressd_schema (
    version integer PRIMARY KEY,
    summary text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""

# One number for every egressd of every fleet: migrations of one database are taken one at a time
# (pg_advisory_xact_lock), so two `state migrate` started together apply each migration once.
MIGRATION_LOCK = 0x6567_7265_7373_6431  # "egressd1"


@dataclass(frozen=True)
class Migration:
    version: int
    summary: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "instances: every egressd of the fleet, with its heartbeat",
        (
            """
            CREATE TABLE egressd_instances (
                id text PRIMARY KEY,
                host text NOT NULL,
                pid integer NOT NULL,
                egressd_version text NOT NULL,
                serving text NOT NULL,
                started_at timestamptz NOT NULL DEFAULT now(),
                heartbeat_at timestamptz NOT NULL DEFAULT now(),
                stopped_at timestamptz
            )
            """,
        ),
    ),
)

LATEST = MIGRATIONS[-1].version


def pending(current: int) -> tuple[Migration, ...]:
    """The migrations a database at version ``current`` still needs, in order."""
    return tuple(m for m in MIGRATIONS if m.version > current)
