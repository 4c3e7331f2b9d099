"""proxy's network shell: listeners, the gate, relays, the resolver and DNS (see ``egressd.proxy``)."""
