"""Where egressd listens and what it answers with, from the settings: its own endpoints, the DNS answers, the limits.

``EgressService`` and each worker of ``--workers`` (``worker.py``) build
their listeners from these, so both refuse a dial to egressd itself and cap
connections the same way.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import NamedTuple

from egressd.config.settings import Settings, parse_hostport
from egressd.names.addresses import IPAddress
from egressd.proxy.core.addresses import OwnEndpoints
from egressd.proxy.core.floods import RefusalBudget
from egressd.proxy.core.modes import ListenerLimits
from egressd.proxy.net.dnsserver import DEFAULT_BURST, DEFAULT_MAX_NAMES_PER_RUN, DEFAULT_RATE_QPS

from .errors import StartupError

# The settings of egressd's TCP listeners (the DNS server answers over TCP too).
_LISTENERS = ("listen", "dns_listen", "transparent_tls", "transparent_http", "socks", "control")
# Where a sandbox reaches "egressd" by the address its DNS answered with: the
# transparent ports and DNS, also when a port forward brings them to a listener.
_ANSWER_PORTS = frozenset({53, 80, 443})


def own_endpoints(settings: Settings, bound: Mapping[str, int] | None = None) -> OwnEndpoints:
    """egressd's own listening endpoints, which no dial may reach (no loops, no control API from a sandbox).

    Every TCP listener's (host, port), the port being the one the kernel gave
    where the setting says 0 (``bound``, by setting name; a listener not bound
    yet is left out); ``localhost`` is 127.0.0.1 and ::1; 0.0.0.0 and :: stand
    for every address of the host on that port. The addresses the DNS answers
    with are where a sandbox is told egressd is: they count as egressd on
    each of those ports and on 53, 80 and 443.
    """
    bound = bound or {}
    endpoints: list[tuple[IPAddress, int]] = []
    for name in _LISTENERS:
        value = getattr(settings, name)
        if value is None or value.startswith("unix:"):
            continue
        host, port = parse_hostport(value, name)
        port = bound.get(name, port)
        if port == 0:
            continue
        texts = ("127.0.0.1", "::1") if host == "localhost" else (host,)
        endpoints += [(ipaddress.ip_address(text), port) for text in texts]
    ports = {port for _, port in endpoints} | _ANSWER_PORTS
    for text in (settings.dns_answer, settings.dns_answer6):
        if text is not None:
            endpoints += [(ipaddress.ip_address(text), port) for port in ports]
    return OwnEndpoints.of(endpoints)


def dns_answers(settings: Settings) -> tuple[ipaddress.IPv4Address, ipaddress.IPv6Address | None]:
    """What A and AAAA queries are answered with; StartupError naming the setting.

    ``dns_answer``, else the transparent listeners' host (DESIGN.md: where a
    tool that resolved a name must land), else the DNS listener's own host.
    """
    if settings.dns_answer is not None:
        answer = ipaddress.ip_address(settings.dns_answer)
        if answer.version != 4:
            raise StartupError(
                f"bad setting dns_answer: {answer} is not an IPv4 address (AAAA answers are dns_answer6)"
            )
    else:
        hosts = {
            parse_hostport(v, n)[0]
            for n, v in (
                ("transparent_tls", settings.transparent_tls),
                ("transparent_http", settings.transparent_http),
            )
            if v is not None
        }
        if len(hosts) > 1:
            raise StartupError(
                "bad setting dns_answer: the transparent listeners are on different hosts "
                f"({', '.join(sorted(hosts))}); name the address the DNS should answer with"
            )
        assert settings.dns_listen is not None
        text = hosts.pop() if hosts else parse_hostport(settings.dns_listen, "dns_listen")[0]
        try:
            answer = ipaddress.ip_address("127.0.0.1" if text == "localhost" else text)
        except ValueError:
            raise StartupError(f"bad setting dns_answer: cannot answer with {text!r}; set dns_answer") from None
        if answer.version != 4 or answer.is_unspecified:
            raise StartupError(
                f"bad setting dns_answer: the listeners are on {text}, which is no IPv4 address to answer with; "
                "set dns_answer"
            )
    answer6: ipaddress.IPv6Address | None = None
    if settings.dns_answer6 is not None:
        given = ipaddress.ip_address(settings.dns_answer6)
        if not isinstance(given, ipaddress.IPv6Address):
            raise StartupError(f"bad setting dns_answer6: {given} is not an IPv6 address")
        answer6 = given
    assert isinstance(answer, ipaddress.IPv4Address)
    return answer, answer6


def listener_limits(settings: Settings, share: int = 1) -> ListenerLimits:
    """The limits every listener applies, from the settings; with workers, each process's share of the caps.

    The connection caps are divided among the processes (rounded down, at
    least one each): a run whose connections all land on one process is
    capped early, never late.
    """
    s = settings
    return ListenerLimits(
        max_head_bytes=s.max_head_bytes,
        head_timeout_s=s.head_timeout_s,
        idle_timeout_s=s.idle_timeout_s,
        connect_timeout_s=s.connect_timeout_s,
        upload_budget_bytes=int(s.upload_budget_mb * 1024 * 1024),
        request_body_cap_bytes=int(s.request_body_cap_mb * 1024 * 1024),
        max_connections=max(1, s.max_connections // share),
        max_connections_per_run=max(1, s.max_connections_per_run // share),
        splice=s.splice,
    )


def refusal_budget(settings: Settings, share: int = 1) -> RefusalBudget:
    """A process's flood budget (``floods``): with workers, its share of each run's refusal records per interval
    (rounded down, at least one), so that the processes together write no more than the setting says."""
    return RefusalBudget(max(1, settings.max_refusal_records // share), settings.refusal_interval_s)


class DnsLimits(NamedTuple):
    """The DNS server's rate per client and names recorded one by one per run (``dnsserver``)."""

    rate_qps: float
    burst: int
    max_names_per_run: int


def dns_limits(share: int = 1) -> DnsLimits:
    """``DnsLimits``; with workers each process's share (rounded down, at least one), so that the processes
    together allow no more than one would."""
    names = max(1, DEFAULT_MAX_NAMES_PER_RUN // share)
    return DnsLimits(DEFAULT_RATE_QPS / share, max(1, DEFAULT_BURST // share), names)
