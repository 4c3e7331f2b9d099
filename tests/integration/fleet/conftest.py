"""The fleet tests' PostgreSQL: tests/postgres.py (its fixtures are the root conftest's, one server per session)."""
