"""The egress gate: everything between a sandboxed client and the world.

Two rooms. ``core`` decides and does no I/O (no event loop, socket, clock or
process; an import contract says so): ``http1`` (a package: heads, framing,
destination, forwarding) and ``exchange`` parse and frame HTTP/1,
``clienthello`` reads a TLS ClientHello, ``policy.decide`` is the design's
decision order as a value, ``addresses`` classifies what a name resolved to,
``reasons`` is the one table of refusals and ``responses`` turns one into
bytes, ``runs`` holds the runs and their allowlists, ``floods`` the refusal
budget, ``metrics`` the counters, ``modes`` what each listener mode is (where a
request goes, how it is attributed, which refusal a limit or a bad head earns),
``dns`` the one DNS codec (the sandbox's queries and our replies, the
resolver's upstream messages) and ``dnsanswer`` what the DNS server answers. Every client connection, in every
mode, is one ``conversation``: a generator of commands (``commands``) with
layers that stack: the way in (``ways``: an HTTP head, a ClientHello, a
SOCKS5 handshake), the decision (``decision``: ``policy.decide``, the
approver asked, the name resolved, every address screened), and what the
connection carries (a spliced tunnel, or HTTP/1 requests framed by ``exchange``).
``net`` executes what the core decides:

1. ``listener`` accepts the client in its mode; a ``runner`` executes its
   conversation's commands and holds what the connection claims until it ends;
2. asking goes through the ``approvals.interface.Approver`` interface, an
   allowed name is resolved by ``resolver``;
3. ``recorder`` writes the ``egress`` record before ``dialer`` dials the
   admitted addresses; ``tunnel`` relays bytes both ways (checked by
   ``tunnelcheck``), or the runner forwards absolute-form HTTP requests one
   at a time as the exchange frames them;
4. every attempt ends as audit facts (``egressd.audit.records``); a refusal is
   a ``reasons.Reason``; past a run's budget of refusal records per interval,
   its refusals are counted into one summary instead (``floods``).

The sandbox-facing side: ``dnsserver`` answers every name with egressd's own
address (as ``core.dnsanswer`` plans) and forwards nothing; a transparent
listener reads the destination of a connection that arrives there from its
ClientHello or its Host header (``ways``), and from then on everything
happens as above. The HTTP control API that drives runs is ``egressd.control``.
Host names and authorities are ``egressd.names``' business.

Which egressd packages this one imports, and the contracts that hold it: docs/architecture.md, "Layers".
"""
