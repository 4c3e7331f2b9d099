"""A worker's copy of the runs (``egressd serve --workers N``): the owner's runs as a value, and the way back.

The owner process holds the runs: the control API creates, edits and ends
them, and a person's answer lands there. Each worker decides its own
connections from a copy: whenever what ``decide`` reads changes in the
owner (``RunRegistry.watch``), every worker is sent the whole of it again
(``image_of``: a ``RegistryImage``, a few entries per run) and its copy
follows (``follow``). Credentials travel with it (the proxy token, so the
worker can attribute; never the control token, which only the owner's
control API takes).

The other way, a worker's copy reports what happens to it (``ReplicaRun``):
an answer applied by one of its conversations (``approve``, ``deny_host``,
... as ``Change`` values the owner applies through the same methods, so
every other worker's next image has it), and each egress event, which the
owner's run keeps for the control API and its ``run.end`` summary.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from egressd.names.addresses import IPAddress
from egressd.proxy.core.budget import Budget
from egressd.proxy.core.policy import Entry
from egressd.proxy.core.runs import Run, RunRegistry


class RunImage(NamedTuple):
    """What a worker needs of one run: who it is, how it is recognised, and what its policy says."""

    id: str
    token: str
    task: str | None
    allow: tuple[Entry, ...]
    deny: tuple[Entry, ...]
    ask: bool
    learn: bool
    sources: frozenset[IPAddress]
    address: IPAddress | None
    command: str | None
    approved: dict[str, frozenset[int]]
    denied: frozenset[str]
    approved_requests: frozenset[tuple[str, str, int, str]]
    denied_requests: frozenset[tuple[str, str, str]]
    global_deny: tuple[Entry, ...]
    started: float


class RegistryImage(NamedTuple):
    """Every live run, which of them is the default one, and the operator's deny entries."""

    runs: tuple[RunImage, ...]
    default: str | None
    global_deny: tuple[Entry, ...]


# What a worker's copy reports, by name: the methods of ``Run`` an answer calls, and an event to keep.
_CHANGES = frozenset({"approve", "deny_host", "stop_asking", "approve_request", "deny_request", "keep_event"})


class Change(NamedTuple):
    """One call a worker's copy of a run saw, for the owner's run: ``Run.<what>(*args)``."""

    run: str
    what: str
    args: tuple[Any, ...]


def image_of(registry: RunRegistry) -> RegistryImage:
    """The registry's runs as a value to send."""
    runs = tuple(
        RunImage(
            id=run.id,
            token=run.token,
            task=run.task,
            allow=run.allow,
            deny=run.deny,
            ask=run.ask,
            learn=run.learn,
            sources=run.sources,
            address=run.address,
            command=run.command,
            approved=dict(run.approved),
            denied=frozenset(run.denied),
            approved_requests=frozenset(run.approved_requests),
            denied_requests=frozenset(run.denied_requests),
            global_deny=run.global_deny,
            started=run.started,
        )
        for run in registry
    )
    default = registry.default.id if registry.default is not None else None
    return RegistryImage(runs, default, registry.global_deny)


class ReplicaRun(Run):
    """A worker's copy of a run: decides as the owner's does, and reports what happens to it (``tell``)."""

    tell: Callable[[Change], None]

    def approve(self, host: str, port: int) -> None:
        super().approve(host, port)
        self.tell(Change(self.id, "approve", (host, port)))

    def deny_host(self, host: str) -> None:
        super().deny_host(host)
        self.tell(Change(self.id, "deny_host", (host,)))

    def stop_asking(self) -> None:
        super().stop_asking()
        self.tell(Change(self.id, "stop_asking", ()))

    def approve_request(self, method: str, host: str, port: int, prefix: str) -> None:
        super().approve_request(method, host, port, prefix)
        self.tell(Change(self.id, "approve_request", (method, host, port, prefix)))

    def deny_request(self, method: str, host: str, prefix: str) -> None:
        super().deny_request(method, host, prefix)
        self.tell(Change(self.id, "deny_request", (method, host, prefix)))

    def budget(self, site: str, grant: int) -> Budget:
        """Starts at nothing: the owner keeps the run's budget and lends this process bytes of it (``budget.lend``)."""
        budget = self.budgets.get(site)
        if budget is None:
            budget = self.budgets[site] = Budget(site, grant, limit=0)
        return budget

    def keep_event(self, record: dict[str, Any]) -> None:
        """Not kept here: the owner's run keeps the events (the control API and ``run.end`` read them there)."""
        self.tell(Change(self.id, "keep_event", (record,)))


def follow(registry: RunRegistry, image: RegistryImage, tell: Callable[[Change], None]) -> None:
    """Make a worker's ``registry`` what ``image`` says: runs begun, ended and changed.

    A run's counters that belong to this process (its open connections,
    its upload budgets) stay with its copy.
    """
    wanted = {run.id: run for run in image.runs}
    for run in list(registry):
        if run.id not in wanted:
            registry.end(run.id)
    registry.global_deny = image.global_deny
    for seen in image.runs:
        run = registry.get(seen.id)
        if run is None:
            copy = ReplicaRun(id=seen.id, token=seen.token, task=seen.task, allow=seen.allow, deny=seen.deny,
                              sources=seen.sources, address=seen.address, started=seen.started)  # fmt: skip
            copy.tell = tell
            _take(copy, seen)
            registry.add(copy)
            if seen.id == image.default:
                registry.default = copy
        else:
            _take(run, seen)
            run.set_entries(seen.allow, seen.deny)  # and forgets the decisions made under the old policy


def _take(run: Run, seen: RunImage) -> None:
    """The policy fields of ``seen``, set without going through the methods a copy reports."""
    run.ask, run.learn, run.command = seen.ask, seen.learn, seen.command
    run.approved = dict(seen.approved)
    run.denied = set(seen.denied)
    run.approved_requests = set(seen.approved_requests)
    run.denied_requests = set(seen.denied_requests)
    run.global_deny = seen.global_deny


def apply_change(registry: RunRegistry, change: Change) -> bool:
    """Apply a worker's ``change`` to the owner's run; False if the run has ended or the change is no change."""
    if change.what not in _CHANGES:
        return False
    run = registry.get(change.run)
    if run is None:
        return False
    getattr(run, change.what)(*change.args)
    return True
