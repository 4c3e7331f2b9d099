"""The runners' contract with a session, for both backends, without creating one."""

from __future__ import annotations

from pathlib import Path

from egressd.audit.views import EgressSeen, Refusal
from egressd.cli.wiring.docker_session import DockerSession
from egressd.cli.wiring.session import SandboxSession, Session, refusal_summaries
from egressd.config.settings import Settings

RECORDS = [
    {"kind": "connect", "host": "evil.test", "port": 443, "decision": "deny", "reason": "not_allowlisted"},
    {"kind": "connect", "host": "pypi.org", "port": 443, "decision": "allow", "reason": None},
    # An AAAA query answered with no address: egressd answered as designed, nothing was refused.
    {"kind": "dns", "host": "pypi.org", "port": None, "decision": "deny", "reason": None},
    {"kind": "dns", "host": "evil.test", "port": None, "decision": "deny", "reason": "denylisted"},
]


def test_only_real_refusals_are_reported() -> None:
    assert [EgressSeen.of(r).is_refusal for r in RECORDS] == [True, False, False, True]
    assert refusal_summaries(RECORDS) == [
        Refusal(host="evil.test", port=443, reason="not_allowlisted", kind="connect"),
        Refusal(host="evil.test", port=None, reason="denylisted", kind="dns"),
    ]


def test_both_backends_offer_the_session_surface(tmp_path: Path) -> None:
    # Checked by name rather than isinstance: ``box`` refuses to be read before the session is entered.
    methods = [name for name in vars(Session) if not name.startswith("_") or name in ("__aenter__", "__aexit__")]
    data = list(Session.__annotations__)
    assert {"box", "run", "set_command", "cursor", "refusals_since", "observe", "__aenter__"} <= set(methods)
    assert data == ["workdir", "made_workdir", "terminal_output", "kind", "exit_status"]
    settings = Settings()
    for session in (
        SandboxSession(settings, workdir=tmp_path, task=None),
        DockerSession(settings, workdir=tmp_path, task=None),
    ):
        cls = type(session)
        found = {m: getattr(cls, m, None) for m in methods}
        missing = [m for m, v in found.items() if not (callable(v) or isinstance(v, property) or m in vars(session))]
        assert missing == [], cls.__name__
        assert [d for d in data if d not in vars(session)] == [], cls.__name__


def test_the_docker_session_reports_refusals_as_the_bubblewrap_one_does(tmp_path: Path) -> None:
    session = DockerSession(Settings(), workdir=tmp_path, task=None)
    cursor = session.cursor()
    session._events.extend(EgressSeen.of(r) for r in RECORDS)  # what polling egressd's control API appends
    assert session.refusals_since(cursor) == refusal_summaries(RECORDS)
    assert session.refusals_since(session.cursor()) == []
