"""Asking a person: the interface the proxy asks through, the broker, and its channels.

The proxy holds a request it may not decide alone and calls
``Approver.ask(ApprovalRequest)``; whatever answers returns an
``ApprovalOutcome``. The proxy never imports a channel.

A request flows:  the decision (``egressd.proxy.core.decision``) → ``ApprovalBroker.ask`` → (``ledger`` opens an
approval, ``message`` renders it once) → every ``Channel.deliver`` at once
→ a person answers through a channel or the control API →
``Answerer.answer`` (allow with a scope: ``once``, ``run`` or ``always``)
→ the ledger settles it (an *always* appends ``host:port`` to the
allowlist file, ``--allow-file``) → the waiting requests wake →
every channel that showed it is told (``Channel.settle``). When every
waiting request's client gave up first, the approval stays open, every
channel is told once (``Channel.abandoned``), and its answer is handed to
the decision, which applies it to the run (``ApprovalRequest.on_late_answer``).

- ``interface``  the values and protocols both sides meet at (``Approver``,
  ``Channel``, ``Answerer``, ``PendingApproval``, ``Settlement``);
- ``message``    the new-domain approval message, escaping, the "unrelated" rule (pure);
- ``ledger``     the approval state machine (pure);
- ``broker``     its asyncio shell: holds, delivers, times out, records;
- ``control``    the control API's ``/approvals`` routes (``egressd pending|allow|deny``);
- ``signing``    Standard Webhooks signing and verification (pure);
- ``terminal``, ``slack``, ``webhook``, ``web``  the channels (``web``: the approvals
  page on the control server; ``webpage`` its pure parts: sessions, the Host rule, HTML;
  ``slackblocks`` the Slack messages as Block Kit, pure; ``prompt`` what the terminal
  draws, pure; ``commandoutput`` a command's output on that terminal, held back while a
  prompt is shown);
- ``relay``      ``TerminalRelay``: ``--approver terminal`` for an egressd in a container, its
  signed webhooks shown by a ``terminal`` prompt, the answers sent to its control API;
- ``deny``       the ``deny`` approver and ``NoApprover``;
- ``assembly``   settings → an approver (the only module that sees the broker
  and the channels together).

Channels never import the broker and the broker never imports a channel:
they meet at ``interface``.

Which egressd packages this one imports, and the contracts that hold it: docs/architecture.md, "Layers".
"""
