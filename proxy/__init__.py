"""The egress gate: everything between a sandboxed client and the world.

A connection flows through these modules, in this order:

1. ``server``   accepts the client, reads the request head (``http1``), and
   attributes it to a run (``runs``) by credentials or source address (the
   transparent listeners: by source address alone);
2. ``gate``     decides: ``policy.decide`` (pure, the design's decision order)
   says allow, deny or ask; asking goes through the ``approvals.Approver``
   interface; an allowed name is resolved (``resolver``) and every address is
   classified (``addresses``) before anything is dialled;
3. ``tunnel``   relays bytes both ways (CONNECT), or ``server`` forwards
   absolute-form HTTP requests one at a time;
4. every attempt ends as exactly one audit record (``audit``); a refusal is a
   ``reasons.Reason``, whose row in the one table gives its status, phrase,
   TLS alert and DNS rcode, and ``responses`` renders it (HTTP or a TLS
   alert); past a run's budget of refusal records per interval, its refusals
   are counted into one summary instead (``floods``).

The sandbox-facing side: ``dnsserver`` answers every name with egressd's own
address and forwards nothing; ``transparent`` reads the destination of a
connection that arrives there from its TLS ClientHello (``clienthello``) or
its Host header, and from then on everything happens as above.

Host names and authorities are ``names``' business (``names.hosts``).
``addresses``, ``policy``, ``http1``, ``clienthello``, ``floods``, ``reasons``
and ``responses`` are pure: no I/O, no clock, no environment; so is the answering
half of ``dnsserver``. ``control`` is the HTTP control API (aiohttp) and
``metrics`` its Prometheus counters.
"""
