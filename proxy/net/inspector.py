"""The two TLS ends of an inspected connection: the run's certificate toward the client, trust toward origins.

A run whose rules name a method or a path (``requestrules``) has its HTTPS
to those names inspected (DESIGN.md "Policy", request rules). For each such
run the inspector holds one certificate authority (``inspectca.RunCA``):
made when the run's CA is first asked for, in memory only, name-constrained
to the run's inspected names, forgotten with the run. Toward the client it
gives a server context per run and name, its leaf certificate minted on
demand; toward origins one client context: the system's trust store (plus
``origin_cafile``, for private origins and tests), the hostname checked,
ALPN offering HTTP/1.1 only (what egressd can inspect).

``ssl`` loads a certificate chain only from a path: the leaf's key goes
through an anonymous memory file (``memfd_create``), never a file on disk.
"""

from __future__ import annotations

import datetime as _dt
import os
import ssl
from collections import OrderedDict
from collections.abc import Callable, Iterable

from egressd.proxy.core.inspectca import InspectCAError, RunCA
from egressd.proxy.core.runs import Run

# Server contexts kept (one per run and name): a context holds its leaf's key; the CA's own
# leaf cache is bounded as well.
MAX_CONTEXTS = 1024
# How long a run's CA is valid: a run lasts hours, not weeks; a margin comes on top (``RunCA``).
CA_LIFETIME = _dt.timedelta(days=2)


def _utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.UTC)


class CannotInspect(Exception):
    """The run's CA does not cover the name (the run's rules changed after its CA was made)."""


class Inspector:
    """The per-run CAs and the TLS contexts built from them, each made when first needed.

    ``origin_cafile`` is loaded at once (a bad file stops egressd's start, ``ssl.SSLError``
    or ``OSError``); the system's trust store when the first inspected request goes upstream.
    """

    def __init__(self, *, origin_cafile: str | None = None, clock: Callable[[], _dt.datetime] = _utcnow) -> None:
        self._clock = clock
        self._cas: dict[str, RunCA] = {}
        self._contexts: OrderedDict[tuple[str, str], ssl.SSLContext] = OrderedDict()
        self._origin_cafile = origin_cafile
        self._origin: ssl.SSLContext | None = None
        if origin_cafile is not None:
            self.origin_context()

    def origin_context(self) -> ssl.SSLContext:
        """The client side toward inspected origins: the system's trust store (and ``origin_cafile``)."""
        if self._origin is None:
            origin = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
            if self._origin_cafile is not None:
                origin.load_verify_locations(cafile=self._origin_cafile)
            origin.set_alpn_protocols(["http/1.1"])
            self._origin = origin
        return self._origin

    def ca(self, run: Run) -> RunCA:
        """The run's CA, made on first use for the run's inspected names."""
        ca = self._cas.get(run.id)
        if ca is None:
            names = sorted(run.inspected_names())
            ca = self._cas[run.id] = RunCA.create(names, self._clock(), CA_LIFETIME, run_id=run.id)
        return ca

    def handed(self, runs: Iterable[Run]) -> dict[str, tuple[bytes, bytes, tuple[str, ...]]]:
        """The CAs of ``runs`` that inspect anything, made now if not yet, for the workers (``RunCA.handed``)."""
        return {run.id: self.ca(run).handed() for run in runs if run.inspected_names()}

    def take(self, handed: dict[str, tuple[bytes, bytes, tuple[str, ...]]]) -> None:
        """A worker takes the owner's CAs (``handed``): the sandbox trusts those, and only those."""
        for run_id in [run_id for run_id in self._cas if run_id not in handed]:
            self.forget(run_id)  # its run ended
        for run_id, ca in handed.items():
            if run_id not in self._cas:
                self._cas[run_id] = RunCA.taken(ca)

    def certificate_pem(self, run: Run) -> bytes:
        """The run's CA certificate (never its key): what the sandbox's trust bundle adds."""
        return self.ca(run).certificate_pem()

    def server_context(self, run: Run, name: str) -> ssl.SSLContext:
        """The client-facing context for ``name`` in ``run``: its leaf, HTTP/1.1 in ALPN.

        Raises ``CannotInspect`` for a name the run's CA does not cover.
        """
        key = (run.id, name)
        context = self._contexts.get(key)
        if context is not None:
            self._contexts.move_to_end(key)
            return context
        try:
            leaf = self.ca(run).leaf(name)
        except InspectCAError as exc:
            raise CannotInspect(str(exc)) from None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])
        _load_chain(context, leaf.chain_pem, leaf.key_pem)
        self._contexts[key] = context
        if len(self._contexts) > MAX_CONTEXTS:
            self._contexts.popitem(last=False)
        return context

    def forget(self, run_id: str) -> None:
        """The run ended: its CA and contexts go (its leaves can be minted no more)."""
        self._cas.pop(run_id, None)
        for key in [key for key in self._contexts if key[0] == run_id]:
            del self._contexts[key]


def _load_chain(context: ssl.SSLContext, chain_pem: bytes, key_pem: bytes) -> None:
    """``load_cert_chain`` from memory: two anonymous memory files, closed at once."""
    chain_fd = os.memfd_create("egressd-chain", os.MFD_CLOEXEC)
    key_fd = os.memfd_create("egressd-key", os.MFD_CLOEXEC)
    try:
        os.write(chain_fd, chain_pem)
        os.write(key_fd, key_pem)
        context.load_cert_chain(f"/proc/self/fd/{chain_fd}", f"/proc/self/fd/{key_fd}")
    finally:
        os.close(chain_fd)
        os.close(key_fd)
