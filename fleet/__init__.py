"""A fleet's shared state: what every egressd of a fleet shares through PostgreSQL (``--state``).

``dsn`` and ``schema`` are pure (what a DSN may be and how it is shown; the
schema's versioned migrations); ``store`` talks to the database through
asyncpg, an optional dependency (``pip install 'egressd[fleet]'``).
"""
