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
    Migration(
        2,
        "approvals: every held request of the fleet, and the answers given for it on other instances",
        (
            # A held request as its holder listed it (``listing``: what the control API shows; no secret is in
            # it, as none is in the audit log), and how it ended. The holder alone writes a row.
            """
            CREATE TABLE egressd_approvals (
                id text PRIMARY KEY,
                instance text NOT NULL,
                run text NOT NULL,
                listing jsonb NOT NULL,
                created_at timestamptz NOT NULL DEFAULT now(),
                expires_at timestamptz NOT NULL,
                settled_at timestamptz,
                settlement jsonb
            )
            """,
            "CREATE INDEX egressd_approvals_open ON egressd_approvals (expires_at) WHERE settled_at IS NULL",
            # An answer given on another instance: a letter to the holder, which alone decides (its own
            # ledger, exactly once). ``state``: NULL (posted), taken (the holder has it), withdrawn (the
            # answerer gave up waiting: the holder will not apply it), replied (``reply`` says what became of it).
            """
            CREATE TABLE egressd_answers (
                seq bigserial PRIMARY KEY,
                approval text NOT NULL REFERENCES egressd_approvals (id) ON DELETE CASCADE,
                holder text NOT NULL,
                given jsonb NOT NULL,
                from_instance text NOT NULL,
                given_at timestamptz NOT NULL DEFAULT now(),
                state text,
                reply jsonb
            )
            """,
            "CREATE INDEX egressd_answers_posted ON egressd_answers (holder) WHERE state IS NULL",
        ),
    ),
    Migration(
        3,
        "rules: the fleet's always answers and shared denials, applied by every instance",
        (
            # One row per *always* answer (its approval's id: written once however often the holder
            # retries), as an allow file's [[approved]] table holds it; a revocation marks it.
            """
            CREATE TABLE egressd_rules (
                approval text PRIMARY KEY,
                entry text NOT NULL,
                at text NOT NULL,
                instance text NOT NULL,
                run text,
                by text,
                channel text,
                auth text,
                kept_at timestamptz NOT NULL DEFAULT now(),
                revoked_at timestamptz,
                revoked_by text,
                revoked_channel text,
                revoked_auth text,
                revoked_on text
            )
            """,
            "CREATE INDEX egressd_rules_standing ON egressd_rules (entry) WHERE revoked_at IS NULL",
            # A denial shared beyond its run (share_denials): it covers ``host``'s registered domain for the
            # runs with the same task (``reach`` task, ``key`` the task) or on the instances of the same group.
            """
            CREATE TABLE egressd_denials (
                approval text PRIMARY KEY,
                reach text NOT NULL CHECK (reach IN ('task', 'group')),
                key text NOT NULL,
                host text NOT NULL,
                at text NOT NULL,
                instance text NOT NULL,
                run text,
                by text,
                channel text,
                denied_at timestamptz NOT NULL DEFAULT now(),
                lifted_at timestamptz,
                lifted_by text
            )
            """,
            "CREATE INDEX egressd_denials_standing ON egressd_denials (denied_at) WHERE lifted_at IS NULL",
            # Each instance's live runs as its last heartbeat listed them (``GET /runs``' fields, no token):
            # what the approvals page of any instance shows as the fleet's runs.
            "ALTER TABLE egressd_instances ADD COLUMN runs jsonb NOT NULL DEFAULT '[]'::jsonb",
        ),
    ),
)

LATEST = MIGRATIONS[-1].version


def pending(current: int) -> tuple[Migration, ...]:
    """The migrations a database at version ``current`` still needs, in order."""
    return tuple(m for m in MIGRATIONS if m.version > current)
