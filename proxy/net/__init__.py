"""proxy's network shell: listeners, the runner, the recorder and the dialer, relays, the resolver, DNS and the control API (see ``egressd.proxy``)."""
