"""The command line: the one place that wires settings, proxy, approvals and audit together.

Which egressd packages this one imports, and the contracts that hold it: docs/architecture.md, "Layers".
"""
