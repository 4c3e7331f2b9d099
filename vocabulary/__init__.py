"""The vocabulary: the words every layer shares, each defined once.

The bottom layer beside ``names``: pure enums and tables, importing nothing
of egressd's, so that no layer spells a code as a string or keeps a table of
its own.

- ``wire``     what a refusal is on each wire: the TLS alert (``Alert``), the
  SOCKS reply (``SocksReply``), the DNS response code (``Rcode``);
- ``reasons``  why a request was refused (``Reason``, with its HTTP status,
  message, alert, SOCKS reply and rcode side by side) and how an approval
  ended (``Answer``, and ``ANSWER_REASONS``: the reason each failed answer is);
- ``egress``   what an audit record says of an attempt: its kind
  (``EgressKind``), its decision (``Decision``), and why an allowed connection
  ended when nothing was refused (``End``).

Which packages import this one, and the contracts that hold it: docs/architecture.md, "Layers".
"""
