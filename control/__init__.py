"""egressd's control API: the HTTP API (aiohttp) that creates, changes and ends runs and answers approvals.

``api`` builds the application: health, metrics and runs behind a bearer token
(the global control token, or a run's own for that run alone), with
``egressd.approvals``' routes and approvals page added to it. It drives the
proxy (``egressd.proxy``: the run registry, the policy's entries, the gate's
metrics) and sits between it and ``egressd.cli``, which starts it
(``egressd.cli.wiring.service``).

Which egressd packages this one imports, and the contracts that hold it: docs/architecture.md, "Layers".
"""
