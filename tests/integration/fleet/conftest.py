"""The fleet tests' PostgreSQL: tests/postgres.py."""

from tests.postgres import PASSWORD, Postgres, database, postgres, running_postgres

__all__ = ["PASSWORD", "Postgres", "database", "postgres", "running_postgres"]
