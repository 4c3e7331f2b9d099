"""proxy's network shell: listeners, the runner, recorder and dialer, relays, the resolver and DNS.

See ``egressd.proxy``.
"""
