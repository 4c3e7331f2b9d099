"""The decision: from a request for HOST:PORT in a run to one final ``Admission``, without I/O.

Every mode decides through ``decide`` (the conversation's decision layer),
the DNS server through the same ``Run.decide``:

1. the audit log must be writable (else refuse: nothing happens unrecorded);
2. ``policy.decide`` — the design's decision order (learn mode included:
   what the allowlist alone would refuse or hold comes back ALLOW with
   ``learned``, which every record of the attempt carries);
3. ASK → an ``Ask`` command: a person is asked through the approver; an
   allow joins the run's allowlist unless its scope is ``once`` (then only
   the requests that waited on that approval go through), a denial sticks
   for the run (its registered domain too), a run past its approval requests
   stops asking (``apply_answer``); the request carries the entry an
   ``always`` answer would keep (``policy.lasting_entry``); an answer that
   comes after the client gave up applies to the run alike (``late_answer``);
4. allowed → a ``Resolve`` command (an IP literal is its own address); every
   address is classified and only those that pass are kept (``Screen``:
   ``private_address`` if none); an address and port where egressd itself
   listens never passes, and when that is why nothing passed the client is
   told so.

The answer is one value, built once: the ``Admission`` (the addresses, or
the reason; the rule, the approval, learn mode's code), which ``conclude``
writes into the attempt; the recorder writes the attempt, the dialer dials
exactly the admitted addresses.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from typing import Final

from egressd.approvals.interface import ApprovalOutcome, ApprovalRequest, ApprovalScope, HeldRequest
from egressd.audit.records import ApprovalSummary
from egressd.names.addresses import IPAddress
from egressd.proxy.core.addresses import OwnEndpoints, forbidden_reason, is_own
from egressd.proxy.core.attempt import Admission, Attempt
from egressd.proxy.core.commands import Ask, Resolve, Steps
from egressd.proxy.core.dns import ResolveError
from egressd.proxy.core.memo import remembered
from egressd.proxy.core.metrics import Metrics
from egressd.proxy.core.policy import EntryError, Verdict, lasting_entry, parse_entry
from egressd.proxy.core.requestrules import RuleError, approval_prefix, suggested_rule
from egressd.proxy.core.responses import OWN_ENDPOINT_MESSAGE
from egressd.proxy.core.runs import Run
from egressd.vocabulary.reasons import ANSWER_REASONS, Answer, Reason

# The refusal each failed answer becomes: the approvals package names its code.
_DENY: Final = Verdict.DENY
_ASK: Final = Verdict.ASK


class Screen:
    """Step 4's address check, with this egressd's settings: which resolved addresses may be dialled.

    ``is_local``: whether an address is one of this host's own (asked only
    for a port where egressd listens on a wildcard address; the network
    shell's ``dialer.bound_locally``).
    """

    def __init__(
        self,
        *,
        allow_private: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
        own: OwnEndpoints | None = None,
        is_local: Callable[[IPAddress], bool] = lambda address: True,
    ) -> None:
        self.allow_private = tuple(allow_private)
        # egressd's listening endpoints; the service updates it as each listener binds.
        self.own = own if own is not None else OwnEndpoints()
        self.is_local = is_local
        self._address_ok: dict[IPAddress, bool] = {}
        self._texts: dict[IPAddress, str] = {}

    def set_allow_private(self, allow_private: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> None:
        """New ``allow_private`` ranges (a reload): addresses are checked against them from the next request on."""
        self.allow_private = tuple(allow_private)
        self._address_ok.clear()  # remembered under the old ranges

    def admission(
        self,
        host: str,
        port: int,
        candidates: Sequence[IPAddress],
        rule: str | None,
        approval: ApprovalSummary | None,
        learned: Reason | None,
    ) -> Admission:
        """The addresses that pass, in order; ``private_address`` (saying which and why) when none does."""
        own_port = port in self.own.ports  # most ports are none of egressd's: one set lookup
        passed = tuple(a for a in candidates if self._dialable(a) and not (own_port and self._own(a, port)))
        if passed:
            return Admission(None, host, port, passed, tuple(map(self._text, passed)), rule, approval, learned)
        itself = next((a for a in candidates if own_port and self._own(a, port)), None)
        if itself is not None:
            detail = f"{self._text(itself)} port {port} is egressd itself (one of its listeners)"
            return Admission(
                Reason.PRIVATE_ADDRESS, host, port, rule=rule, approval=approval, learned=learned,
                address=str(itself), message=OWN_ENDPOINT_MESSAGE, detail=detail,
            )
        address = str(candidates[0]) if candidates else None
        hint = private_hint(address) if address is not None else None
        return Admission(
            Reason.PRIVATE_ADDRESS, host, port, rule=rule, approval=approval, learned=learned, address=address,
            message=f"{Reason.PRIVATE_ADDRESS.message} ({address}; {hint})" if hint else None,
        )

    # Pure functions of their argument (and of the fixed settings): their answers are remembered.
    def _text(self, address: IPAddress) -> str:
        return remembered(self._texts, address, str)

    def _dialable(self, address: IPAddress) -> bool:
        return remembered(self._address_ok, address, self._check_address)

    def _check_address(self, address: IPAddress) -> bool:
        return forbidden_reason(address, self.allow_private) is None

    def _own(self, address: IPAddress, port: int) -> bool:
        # Not remembered: a wildcard listener's answer depends on the interfaces of the moment.
        return is_own(address, port, self.own, self.is_local)


def private_hint(address: str) -> str:
    """How to let a refused private address through, when it is yours: the setting that does it."""
    prefix = 128 if ":" in address else 32
    return f"if it is yours: --allow-private {address}/{prefix}"


def decide(
    host: str, port: int, run: Run, screen: Screen, metrics: Metrics, audit_healthy: bool, on_eof: bool
) -> Steps:
    """Steps 1-4 for ``host``:``port`` in ``run`` → the whole ``Admission``; yields ``Ask`` and ``Resolve``.

    ``on_eof``: the client's FIN stops a wait (a tunnel cannot go on without sending).
    ``conclude`` then writes the decision into the attempt, in one place.
    """
    if not audit_healthy:
        return Admission(Reason.AUDIT_UNAVAILABLE, host, port)
    verdict = run.decide(host, port)
    host, rule = verdict.host, verdict.rule
    learned = None
    if verdict.learned is not None:
        learned = verdict.learned
        metrics.learned += 1
    if verdict.verdict is _DENY:
        return Admission(verdict.reason, host, port, rule=rule, learned=learned)
    approval = None
    if verdict.verdict is _ASK:
        outcome: ApprovalOutcome = yield Ask(approval_request(run, host, port), on_eof)
        approval = ApprovalSummary(outcome.approval_id, outcome.channel, outcome.by, round(outcome.waited_s, 3))
        refused = apply_answer(run, host, port, outcome)
        if refused is not None:
            return Admission(refused, host, port, rule=rule, approval=approval, learned=learned)
        rule = "approved"
    if verdict.address is not None:
        candidates: Sequence[IPAddress] = [verdict.address]
    else:
        try:
            candidates = yield Resolve(host, on_eof)
        except ResolveError as exc:
            return Admission(
                Reason.RESOLVE_FAILED, host, port, rule=rule, approval=approval, learned=learned, detail=str(exc)
            )
    admission = screen.admission(host, port, candidates, rule, approval, learned)
    if verdict.inspect and admission.reason is None:
        return admission._replace(inspect=True)
    return admission


def decide_request(
    run: Run, tunnel: Admission, method: str, path: str, shown: HeldRequest, audit_healthy: bool
) -> Steps:
    """One request inside an inspected tunnel, on its method and normalised path → its ``Admission``.

    The tunnel's host, port and admitted addresses stand (checked once, when
    it was decided); the run's request rules decide the request
    (``Run.decide_request``); a request no rule covers is asked about like a
    new domain, the request shown (``Ask``; the client's FIN does not stop
    the wait: a client may half-close after its request).
    """
    host, port = tunnel.host, tunnel.port
    if not audit_healthy:
        return Admission(Reason.AUDIT_UNAVAILABLE, host, port)
    verdict = run.decide_request(method, host, port, path)
    if verdict.verdict is _DENY:
        return Admission(verdict.reason, host, port, rule=verdict.rule, learned=verdict.learned)
    rule, approval = verdict.rule, None
    if verdict.verdict is _ASK:
        outcome: ApprovalOutcome = yield Ask(request_approval(run, host, port, method, path, shown), False)
        approval = ApprovalSummary(outcome.approval_id, outcome.channel, outcome.by, round(outcome.waited_s, 3))
        refused = apply_request_answer(run, host, port, method, path, outcome)
        if refused is not None:
            return Admission(refused, host, port, approval=approval)
        rule = "approved"
    return tunnel._replace(rule=rule, approval=approval, learned=verdict.learned, inspect=False)


def conclude(attempt: Attempt, admission: Admission) -> None:
    """The attempt is decided: the one place its decision is written (from the ``Admission``)."""
    attempt.conclude(admission)


def approval_request(run: Run, host: str, port: int) -> ApprovalRequest:
    """What the approver is asked for ``host``:``port`` in ``run``."""
    lasting: str | None = None
    lasting_error: str | None = None
    try:
        lasting = lasting_entry(host, port)
    except EntryError as exc:
        lasting_error = str(exc)
    return _question(run, host, port, lasting, lasting_error, lambda outcome: late_answer(run, host, port, outcome))


def _question(
    run: Run,
    host: str,
    port: int,
    lasting: str | None,
    lasting_error: str | None,
    on_late_answer: Callable[[ApprovalOutcome], None] | None = None,
    *,
    request: HeldRequest | None = None,
    uploaded: int | None = None,
) -> ApprovalRequest:
    """An approval request about ``host``:``port`` in ``run``, or about a request there, or an upload to it."""
    return ApprovalRequest(
        run_id=run.id,
        host=host,
        port=port,
        command=run.command,
        task=run.task,
        allowed=run.allowed_texts(),
        lasting=lasting,
        lasting_error=lasting_error,
        on_late_answer=on_late_answer,
        request=request,
        uploaded=uploaded,
    )


def budget_approval(run: Run, site: str, port: int, sent: int) -> ApprovalRequest:
    """What the approver is asked when the run passes its upload budget to ``site`` (``budget``)."""
    return _question(run, site, port, None, "an upload budget's answer lasts for this run only", uploaded=sent)


def cap_approval(run: Run, host: str, port: int, shown: HeldRequest, sent: int) -> ApprovalRequest:
    """What the approver is asked when one request's body passes the per-request cap (``sent`` bytes so far)."""
    return _question(run, host, port, None, "a body cap's answer is for this request only", request=shown,
                     uploaded=sent)


def settled_meanwhile(run: Run, host: str, port: int) -> ApprovalOutcome | None:
    """What answers a worker's question about ``host``:``port`` that reached the owner after the run's answer
    (``--workers``: it asked from its copy of the run): allowed, once (the run holds the approval already), or
    denied; None while a person is still to be asked."""
    verdict = run.decide(host, port).verdict
    if verdict is _ASK:
        return None
    return ApprovalOutcome(Answer.DENY if verdict is _DENY else Answer.ALLOW, scope=ApprovalScope.ONCE)


def apply_answer(run: Run, host: str, port: int, outcome: ApprovalOutcome) -> Reason | None:
    """What an answer does to the run; the reason the request is refused with, None when it goes on."""
    if not outcome.allowed:
        if outcome.answer is Answer.DENY:
            run.deny_host(host)
        elif outcome.answer is Answer.STOPPED_ASKING:
            run.stop_asking()
        return ANSWER_REASONS[outcome.answer]
    if run.ended:
        # Allowed after its run ended (the sandbox is gone): its credentials are void.
        return Reason.AUTH_REQUIRED
    if outcome.scope is not ApprovalScope.ONCE:
        run.approve(host, port)
    return None


def request_approval(run: Run, host: str, port: int, method: str, path: str, shown: HeldRequest) -> ApprovalRequest:
    """What the approver is asked for a request no rule covers inside an inspected connection.

    An *always* answer keeps the rule ``requestrules.suggested_rule`` gives (the method on the
    path's prefix); *run* approves that method and prefix for the run; *once* this request.
    """
    lasting: str | None = None
    lasting_error: str | None = None
    try:
        lasting = suggested_rule(method, host, port, path)
        parse_entry(lasting)
    except (EntryError, RuleError) as exc:
        lasting, lasting_error = None, str(exc)
    return _question(
        run, host, port, lasting, lasting_error,
        lambda outcome: _late_request(run, host, port, method, path, outcome), request=shown,
    )  # fmt: skip


def apply_request_answer(
    run: Run, host: str, port: int, method: str, path: str, outcome: ApprovalOutcome
) -> Reason | None:
    """What an answer about a request does to the run; the reason it is refused with, None when it goes on."""
    return _apply_request(run, host, port, method, path, outcome, late=False)


def _late_request(run: Run, host: str, port: int, method: str, path: str, outcome: ApprovalOutcome) -> None:
    """An answer that came after the client gave up still applies to the run (not once, not to an ended run)."""
    _apply_request(run, host, port, method, path, outcome, late=True)


def _apply_request(
    run: Run, host: str, port: int, method: str, path: str, outcome: ApprovalOutcome, *, late: bool
) -> Reason | None:
    prefix = approval_prefix(path)
    if not outcome.allowed:
        if outcome.answer is Answer.DENY:
            run.deny_request(method, host, prefix)
        elif outcome.answer is Answer.STOPPED_ASKING:
            run.stop_asking()
        return ANSWER_REASONS[outcome.answer]
    if outcome.scope is not ApprovalScope.ONCE and not (late and run.ended):
        run.approve_request(method, host, port, prefix)
    return None


def late_answer(run: Run, host: str, port: int, outcome: ApprovalOutcome) -> None:
    """An answer that came after every client waiting for it gave up still applies to the run.

    Allow → the host joins the run's allowlist (not for an ended run, and
    not for scope ``once``: it covered only the requests that waited);
    deny → the denial sticks; a timeout or shutdown applies nothing.
    """
    if outcome.answer is Answer.ALLOW and outcome.scope is not ApprovalScope.ONCE and not run.ended:
        run.approve(host, port)
    elif outcome.answer is Answer.DENY:
        run.deny_host(host)
