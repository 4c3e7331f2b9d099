"""Asking a person: the interface the proxy asks through, and its answerers.

The proxy holds a request it may not decide alone and calls
``Approver.ask(ApprovalRequest)``; whatever answers returns an
``ApprovalOutcome``. The proxy never imports a channel, and channels never
import the broker: both sides meet only at ``approvals.interface``.

- ``interface``  the request/outcome values and the ``Approver`` protocol;
- ``deny``       the ``deny`` approver (answers every request with a denial at
  once) and the ``NoApprover`` used when nobody is attached.
"""
