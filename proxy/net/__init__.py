"""proxy's network shell: listeners, the gate, relays, the resolver, DNS and the control API (see ``egressd.proxy``)."""
