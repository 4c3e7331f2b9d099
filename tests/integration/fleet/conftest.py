"""The fleet tests' PostgreSQL: tests/postgres.py (its fixtures are the root conftest's, one server per session)."""

from __future__ import annotations

import pytest

from tests.integration.fleet.instances import migrated
from tests.postgres import Postgres


@pytest.fixture
async def dsn(postgres: Postgres, database: str) -> str:
    """A fresh database of the session's server, migrated: the fleet's."""
    uri = postgres.dsn(database)
    await migrated(uri)
    return uri
