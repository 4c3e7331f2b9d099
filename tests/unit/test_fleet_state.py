"""The state setting's URI and the fleet schema's migrations, without a database."""

from __future__ import annotations

import pytest

from egressd.config.settings import Settings, SettingsError, load_settings
from egressd.fleet import dsn
from egressd.fleet.schema import LATEST, MIGRATIONS, pending


@pytest.mark.parametrize(
    "uri",
    [
        "postgresql://egressd@db.internal/egressd",
        "postgres://egressd:pw@10.0.0.5:5433/fleet?sslmode=require",
        "postgresql://egressd@/fleet?host=/run/postgresql",
    ],
)
def test_a_postgresql_uri_naming_its_database_is_taken(uri: str) -> None:
    assert dsn.check(uri) == uri


@pytest.mark.parametrize(
    ("uri", "said"),
    [
        ("mysql://h/db", "must start postgresql://"),
        ("postgresql://h", "name the database"),
        ("postgresql://h/", "name the database"),
        ("postgresql://h:notaport/db", "not a PostgreSQL URI"),
        ("postgresql://h/db#x", "no #fragment"),
    ],
)
def test_a_uri_egressd_cannot_use_is_refused_with_why(uri: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        dsn.check(uri)


def test_the_password_is_never_shown() -> None:
    assert dsn.shown("postgresql://egressd:s3cret@db/fleet") == "postgresql://egressd:***@db/fleet"
    assert dsn.shown("postgresql://egressd@db/fleet?password=s3cret&sslmode=require") == (
        "postgresql://egressd@db/fleet?password=***&sslmode=require"
    )
    with pytest.raises(ValueError) as refused:
        dsn.check("mysql://egressd:s3cret@db/fleet")
    assert "s3cret" not in str(refused.value)


def test_the_state_setting_is_checked_and_its_error_hides_the_password() -> None:
    assert load_settings({"state": "postgresql://egressd@db/fleet"}).state is not None
    with pytest.raises(SettingsError) as refused:
        load_settings({"state": "postgresql://egressd:s3cret@db"})
    assert "state" in str(refused.value) and "s3cret" not in str(refused.value)
    assert Settings().state is None  # without it, nothing is shared


def test_migrations_are_numbered_from_one_without_a_gap() -> None:
    assert [m.version for m in MIGRATIONS] == list(range(1, len(MIGRATIONS) + 1))
    assert LATEST == len(MIGRATIONS)
    assert all(m.statements and all(s.strip() for s in m.statements) for m in MIGRATIONS)
    assert pending(0) == MIGRATIONS and pending(LATEST) == ()
