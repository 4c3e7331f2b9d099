"""proxy's network shell: listeners, the runner, recorder and dialer, relays, resolver, DNS, control API.

See ``egressd.proxy``.
"""
