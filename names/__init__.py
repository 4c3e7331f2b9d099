"""Names: how egressd spells and shows hosts, authorities and addresses, in one place each.

The bottom layer: pure (no I/O, no clock, no environment, except that the
bundled Public Suffix List is read once, lazily) and importing no other
egressd package, so every package above may use it.

- ``suffixes``   the Public Suffix List: one lazily parsed copy that the policy
  and the approval message both ask;
- ``hosts``      host names and IP literals: parsing, IDNA and the one
  canonical form every comparison uses (``normalise_host``; ``parse_host``
  gives it with the IP address, from one parse);
- ``authority``  ``HOST:PORT`` text: the one parser, whose callers' differing
  rules (default port, port 0, digits, colons, error order) are its parameters;
- ``addresses``  the ``IPAddress`` type and ``unmapped`` (an IPv4-mapped IPv6
  address is the IPv4 address it maps);
- ``shown``      untrusted text made safe to show, one function per set of
  rules: terminals and chats (``escape``, Unicode kept; ``TerminalText``),
  Slack (``escape_mrkdwn``), the agent CLI (``printable``), HTTP refusals and
  the audit reader (``ascii_escaped``), log lines (``logged``), DNS labels
  (``shown_name``), error messages (``quoted``).

``shown``, ``addresses`` and ``suffixes`` use nothing; ``hosts`` uses them;
``authority`` uses ``hosts`` and ``shown``.

Which packages import this one, and the contracts that hold it: docs/architecture.md, "Layers".
"""
