"""proxy's core: parsing, deciding and rendering, with no I/O (see ``egressd.proxy``)."""
