"""The command line: the one place that wires settings, proxy, approvals and audit together."""
