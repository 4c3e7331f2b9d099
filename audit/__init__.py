"""The audit log: one JSON Lines record per egress attempt, run and approval.

- ``records``  builds records as plain dicts (pure; never payloads,
  credentials or query strings);
- ``line``     a record as the text of its line (``json.dumps``'s bytes,
  the common shapes through a template made once);
- ``log``      the single appending writer (``JsonlAuditSink``), which fails
  closed: once a write fails, ``healthy`` is false and the proxy refuses new
  egress; and the in-memory sink used by tests;
- ``query``    reading, filtering and following the log for ``egressd audit``;
- ``display``  records as lines to print: a table for a terminal (escaped), or JSON Lines;
- ``chain``    the hash chain checked (``egressd audit verify``);
- ``views``    an egress record read back once into what ``egressd run`` and
  ``egressd agent`` show of it (``EgressSeen``, ``Refusal``).

Which egressd packages this one imports, and the contracts that hold it: docs/architecture.md, "Layers".
"""
