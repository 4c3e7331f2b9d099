"""The control API (aiohttp): health, metrics and runs, behind a bearer token.

Two kinds of bearer token, and what each can do:

- The global control token (``--control-token``, or the token file egressd
  writes) has full power over every run: whoever holds it can create runs,
  list them, rewrite any run's command — the command every approver is shown
  when that run asks — end any run, and see and answer any run's approvals,
  so it can allow any egress. Give it to the operator only.
- A run's own control token, returned by ``POST /runs`` as
  ``control_token`` (256 random bits; never logged, never in the audit log,
  never in ``GET /runs``), acts on that run alone: ``GET /runs/ID``,
  ``PUT /runs/ID/command``, ``GET /runs/ID/events``, ``DELETE /runs/ID``
  for its own ID, and ``GET /approvals`` / ``POST /approvals/ID/allow|deny``
  narrowed to its run's approvals (``egressd.approvals.control``). Everything else —
  another run, creating or listing runs, ``/metrics`` (which counts every
  run's traffic), any route added later — is 403 with a JSON error. It dies
  with the run: once the run is ended its token is refused (401).
  ``egressd run --connect`` creates its run with the global token and uses
  the run's token from then on; a ``--connect`` user can be handed a run
  token instead, and ``egressd pending|allow|deny`` take it like any other.

Routes (JSON unless said otherwise):

- ``GET /health``                      no token needed; ``{"status", "audit", "runs"}``
- ``GET /metrics``                     Prometheus text
- ``GET /runs``                        every live run
- ``POST /runs``                       ``{"task", "allow", "deny", "preset", "ask", "sources", "address"}``
                                       → ``{"id", "token", "proxy_url", "control_token"}``
                                       (global token only); ``address``: egressd's
                                       own address on a network of the run's own, which its
                                       proxy URL names and its DNS answers with (the proxy must
                                       listen on every address, or on that one)
- ``GET /runs/{id}``                   one run
- ``PATCH /runs/{id}``                 ``{"allow": {"add": [...], "remove": [...]}, "deny": {"add": [...],
                                       "remove": [...]}}`` (each part optional; global token only: a
                                       run never widens its own policy) → the run as ``GET`` shows it;
                                       removals first, then additions, for the run's next request;
                                       a bad entry, or the removal of an entry the run does not have
                                       (its ``global_deny`` is the operator's), is a 400 naming it and
                                       nothing is applied; adding an entry it has changes nothing.
                                       Recorded as ``run.changed`` (also when nothing changed)
                                       ``"revoke": ["HOST", "HOST:PORT"]`` takes back approvals given
                                       for the run and the allow file's *always* entries for the
                                       same (for every run): 400 when neither has it
- ``GET /always``                      the allow file's standing *always* answers
                                       → ``{"always": [{"entry", "at", "by", "channel", "run"}]}``
- ``PUT /runs/{id}/command``           ``{"command": str|null}``: what the run executes now
- ``GET /runs/{id}/events?cursor=N``   egress records after cursor N → ``{"events", "cursor"}``
- ``DELETE /runs/{id}``                end the run

Other packages add routes of their own to the application before it starts
(approvals will); the token check covers every route except those whose path
is in ``app[PUBLIC_PATHS]``, and puts the caller's ``Scope`` on each request
(``request[SCOPE]``) for handlers that narrow what a run's token sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import itertools
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from egressd.approvals.control import RUN_SCOPED_ROUTES, SCOPE, Scope
from egressd.approvals.webcontrol import CONTROL_VIEW, ControlView, RevokeError
from egressd.audit.log import AuditError
from egressd.audit.records import run_changed_record, run_record
from egressd.config.allowfile import Approved, LastingError
from egressd.config.presets import UnknownPreset, preset_entries
from egressd.names.hosts import normalised, split_port
from egressd.proxy.core.addresses import forbidden_reason
from egressd.proxy.core.decision import Screen
from egressd.proxy.core.metrics import Metrics
from egressd.proxy.core.policy import Entry, EntryError, lasting_entry, parse_entry
from egressd.proxy.core.runs import Run, RunError, RunRegistry
from egressd.proxy.net.inspector import Inspector
from egressd.proxy.net.recorder import Recorder


@dataclass(frozen=True, slots=True)
class Lasting:
    """The allow file's *always* answers, for the control server (``egressd.cli.wiring.lasting`` makes it).

    ``standing``: the answers no revocation took back; ``revoke(entries,
    by, channel, auth)``: append a ``[[revoked]]`` table per entry and apply
    the file again to the running policy; LastingError changes nothing. In a fleet (``serve --state``)
    the fleet's rules are listed and revoked too (``egressd.cli.wiring.fleetlasting``).
    """

    standing: Callable[[], Sequence[Approved]]
    revoke: Callable[[Sequence[str], str | None, str | None, str | None], None]


RECORDER = web.AppKey("recorder", Recorder)
SCREEN = web.AppKey("screen", Screen)
RUNS = web.AppKey("runs", RunRegistry)
PROXY_ADDRESS = web.AppKey("proxy_address", tuple)
PUBLIC_PATHS = web.AppKey("public_paths", set)
TOKEN = web.AppKey("token", str)
INSPECTOR: web.AppKey[Inspector | None] = web.AppKey("inspector")
SECRETS: web.AppKey[dict[str, str]] = web.AppKey("secrets")
LASTING: web.AppKey[Lasting | None] = web.AppKey("lasting")
# The other processes' metrics and task counts (``serve --workers``), asked for at each scrape.
MORE_METRICS: web.AppKey[Callable[[], Awaitable[list[tuple[Metrics, int]]]] | None] = web.AppKey("more_metrics")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The routes a run's own token may use; those naming a run (``{run_id}``) only for its run.
_RUN_ROUTES = frozenset(
    {
        ("GET", "/runs/{run_id}"),
        ("PUT", "/runs/{run_id}/command"),
        ("GET", "/runs/{run_id}/events"),
        ("DELETE", "/runs/{run_id}"),
        # Its CA certificate (never the key), for the launcher that installs it in the run's sandbox.
        ("GET", "/runs/{run_id}/ca"),
    }
) | RUN_SCOPED_ROUTES


def json_error(status: int, message: str) -> web.HTTPException:
    """An HTTP error whose body is ``{"error": message}``."""
    classes: dict[int, type[web.HTTPException]] = {
        400: web.HTTPBadRequest,
        401: web.HTTPUnauthorized,
        404: web.HTTPNotFound,
        403: web.HTTPForbidden,
        409: web.HTTPConflict,
        500: web.HTTPInternalServerError,
    }
    return classes[status](text=json.dumps({"error": message}), content_type="application/json")


def token_scope(app: web.Application, given: str) -> Scope | None:
    """What a token may act on: every run (the global token), a live run's own, or None (no token of ours)."""
    if not given:
        return None
    if hmac.compare_digest(given.encode(), app[TOKEN].encode()):
        return Scope(run_id=None)
    run = app[RUNS].by_control_token(given)
    return Scope(run_id=run.id) if run is not None else None


def _scope(request: web.Request) -> Scope:
    """Who the bearer token says the caller is: the global token, a live run's own token, or 401."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    given = given.strip()
    scope = token_scope(request.app, given) if scheme.lower() == "bearer" else None
    if scope is None:
        raise json_error(401, "missing or wrong bearer token")
    return scope


def _check_run_route(request: web.Request, scope: Scope) -> None:
    """A run's token: only ``_RUN_ROUTES``, and those naming a run only for its own (else 403).

    An allowlist, so a route added later is closed to run tokens until it
    is listed here or in ``egressd.approvals.control.RUN_SCOPED_ROUTES``.
    """
    resource = request.match_info.route.resource
    pattern = resource.canonical if resource is not None else None
    if (request.method, pattern) not in _RUN_ROUTES:
        raise json_error(403, f"a run's control token acts on its own run ({scope.run_id}) only: "
                              f"{request.method} {request.path} needs the global control token")
    named = request.match_info.get("run_id")
    if named is not None and named != scope.run_id:
        raise json_error(403, f"a run's control token acts on its own run ({scope.run_id}) only, "
                              f"not on run {named}")


@web.middleware
async def _require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path in request.app[PUBLIC_PATHS]:
        return await handler(request)
    scope = _scope(request)
    if scope.run_id is not None:
        _check_run_route(request, scope)
    request[SCOPE] = scope
    return await handler(request)


def parse_entries(texts: Any, what: str) -> tuple[Entry, ...]:
    """Allow/deny entries from JSON; raises a 400 naming the bad entry."""
    if texts is None:
        return ()
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise json_error(400, f"{what} must be a list of strings")
    try:
        return tuple(parse_entry(t) for t in texts)
    except EntryError as exc:
        raise json_error(400, f"{what}: {exc}") from None


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise json_error(400, "body is not JSON") from None
    if not isinstance(body, dict):
        raise json_error(400, "body must be a JSON object")
    return body


def _run(request: web.Request) -> Run:
    run = request.app[RUNS].get(request.match_info["run_id"])
    if run is None:
        raise json_error(404, f"no run {request.match_info['run_id']}")
    return run


def _write_audit(app: web.Application, record: dict[str, Any]) -> None:
    try:
        app[RECORDER].audit.write(record)
    except AuditError:
        pass  # the sink is now unhealthy and says so; egress is refused from here on


async def health(request: web.Request) -> web.Response:
    healthy = request.app[RECORDER].audit.healthy
    return web.json_response(
        {"status": "ok" if healthy else "degraded", "audit": healthy, "runs": len(request.app[RUNS])},
        status=200 if healthy else 503,
    )


async def metrics(request: web.Request) -> web.Response:
    recorder = request.app[RECORDER]
    counted, tasks = recorder.metrics, len(asyncio.all_tasks())
    others = request.app[MORE_METRICS]
    if others is not None:  # serve --workers: every process's counters, one egressd's figures
        theirs = await others()
        counted = counted.merged([metrics for metrics, _ in theirs])
        tasks += sum(count for _, count in theirs)
    text = counted.render(runs=len(request.app[RUNS]), audit_healthy=recorder.audit.healthy, tasks=tasks)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def list_runs(request: web.Request) -> web.Response:
    return web.json_response({"runs": [run.describe() for run in request.app[RUNS]]})


async def create_run(request: web.Request) -> web.Response:
    body = await _body(request)
    task = body.get("task")
    if task is not None and not isinstance(task, str):
        raise json_error(400, "task must be a string")
    presets = body.get("preset") or []
    if not isinstance(presets, list):
        raise json_error(400, "preset must be a list of names")
    try:
        preset_texts = [text for name in presets for text in preset_entries(name)]
    except UnknownPreset as exc:
        raise json_error(400, str(exc)) from None
    allow = parse_entries(body.get("allow") or [], "allow") + parse_entries(preset_texts, "preset")
    deny = parse_entries(body.get("deny"), "deny")
    sources_raw = body.get("sources") or []
    try:
        sources = [ipaddress.ip_address(s) for s in sources_raw]
    except (TypeError, ValueError):
        raise json_error(400, "sources must be a list of IP addresses") from None
    ask = body.get("ask", True)
    if not isinstance(ask, bool):
        raise json_error(400, "ask must be true or false")
    address = _run_address(body.get("address"), request.app[PROXY_ADDRESS][0], request.app[SCREEN].allow_private)
    try:
        run = request.app[RUNS].create(task=task, allow=allow, deny=deny, ask=ask, sources=sources, address=address,
                                       started=time.time())
    except RunError as exc:
        raise json_error(409, str(exc)) from None
    _write_audit(
        request.app,
        run_record(
            "run.start",
            ts=time.time(),
            run=run.id,
            task=task,
            allow=[e.text for e in allow],
            deny=[e.text for e in deny],
            sources=[str(s) for s in sources],
            **({"address": str(address)} if address is not None else {}),
            **({"learn": True} if run.learn else {}),
        ),
    )
    host, port = request.app[PROXY_ADDRESS]
    host = str(address) if address is not None else host
    host = f"[{host}]" if ":" in host else host
    return web.json_response(
        {
            "id": run.id,
            "token": run.token,
            "proxy_url": f"http://{run.id}:{run.token}@{host}:{port}",
            "control_token": run.control_token,
            # The declared secrets' placeholders, for the launcher to put in the command's environment
            # under each secret's name (never a value: egressd puts that in itself).
            **({"secrets": request.app[SECRETS]} if request.app[SECRETS] else {}),
        },
        status=201,
    )


def _run_address(
    raw: Any, proxy_host: str, allow_private: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]
) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``POST /runs``'s ``address``: one the proxy listens on and egressd never dials.

    1. not an IP address → 400;
    2. the proxy listens on neither every address nor this one → 409 (the
       run's sandbox could reach nothing there: refused now, not at its first
       request);
    3. egressd would dial it (public, or inside ``allow_private``) → 409: an
       allowed name resolving there would loop back into egressd's own
       listeners, as a client bound to no run — or to another run's policy.
    """
    if raw is None:
        return None
    try:
        address = ipaddress.ip_address(raw)
    except (TypeError, ValueError):
        raise json_error(400, "address must be an IP address") from None
    try:
        listening = ipaddress.ip_address(proxy_host)
    except ValueError:
        listening = None  # a name (localhost): never one of a run's own network
    every = listening is not None and listening.is_unspecified and listening.version in (address.version, 6)
    if not (every or listening == address):
        raise json_error(409, f"the proxy listens on {proxy_host} only, not on {address}: a run on a network "
                              "of its own needs egressd listening on every address of its container (0.0.0.0)")
    if forbidden_reason(address, allow_private) is None:
        raise json_error(409, f"egressd would dial {address}, its own address on the run's network: "
                              "allow_private must not cover egressd's networks")
    return address


async def get_run(request: web.Request) -> web.Response:
    return web.json_response(_run(request).describe())


async def change_run(request: web.Request) -> web.Response:
    """``PATCH /runs/{id}``: add and remove the run's own entries, all or nothing."""
    run = _run(request)
    body = await _body(request)
    strange = sorted(set(body) - {"allow", "deny", "revoke"})
    if strange:
        raise json_error(400, f"unknown key {strange[0]!r}: allow, deny and revoke only")
    revoke = body.get("revoke") or []
    if not isinstance(revoke, list) or not all(isinstance(text, str) for text in revoke):
        raise json_error(400, 'revoke must be a list of "host" or "host:port"')
    edits: dict[str, tuple[Entry, ...]] = {}
    for kind in ("allow", "deny"):
        part = body.get(kind) or {}
        if not isinstance(part, dict):
            raise json_error(400, f'{kind} must be an object: {{"add": [...], "remove": [...]}}')
        strange = sorted(set(part) - {"add", "remove"})
        if strange:
            raise json_error(400, f"{kind}: unknown key {strange[0]!r}: add and remove only")
        for action in ("add", "remove"):
            edits[f"{kind}_{action}"] = parse_entries(part.get(action), f"{kind}.{action}")
    try:
        in_run, always = revocations(run, revoke, request.app[LASTING])  # all or nothing: checked first
        change = run.change_entries(**edits)
        revoked = run.revoke(in_run) if in_run else []
    except RunError as exc:
        raise json_error(400, str(exc)) from None
    failure = None
    try:
        take_back_always(request.app, always, by=None, channel=None, auth=None)
    except LastingError as exc:  # the run's own changes are made; of the always entries, what was taken back
        lasting = request.app[LASTING]
        standing = {a.entry for a in lasting.standing()} if lasting is not None else set()
        failure, always = str(exc), [entry for entry in always if entry not in standing]
    # Recorded even when it changed nothing: whoever holds the global token tried to.
    _write_audit(request.app, run_changed_record(ts=time.time(), run=run.id, added=change.added, removed=change.removed,
                                             revoked=revoked, always_revoked=always))  # fmt: skip
    if failure is not None:
        raise json_error(500, f"the always entries were not revoked ({failure}); the run's own changes were made "
                              "and recorded")  # fmt: skip
    return web.json_response(run.describe())


def revocations(run: Run, texts: Sequence[str], lasting: Lasting | None) -> tuple[list[str], list[str]]:
    """What ``revoke`` texts take back: (the run's own approvals, the *always* entries); RunError when a text
    names neither (nothing is taken back then).

    ``HOST`` matches the entries for the host on every port, ``HOST:PORT`` the one.
    """
    standing = [a.entry for a in lasting.standing()] if lasting is not None else []
    in_run: list[str] = []
    always: list[str] = []
    for text in texts:
        name, port_text = split_port(text)
        host = normalised(name)
        wanted: list[str] = []
        if host is not None and port_text.isdigit() and 1 <= int(port_text) <= 65535:
            with contextlib.suppress(EntryError):
                wanted = [e for e in standing if e == lasting_entry(host, int(port_text))]
        elif host is not None and not port_text:
            wanted = [e for e in standing if normalised(split_port(e)[0]) == host]
        try:
            run.revoke([text], check_only=True)
        except RunError as exc:
            if not wanted:
                raise RunError(f"{exc}, nor is there an always entry for it") from None
        else:
            in_run.append(text)
        always.extend(e for e in wanted if e not in always)
    return in_run, always


def take_back_always(app: web.Application, entries: Sequence[str], *, by: str | None, channel: str | None,
                     auth: str | None) -> None:
    """Revoke the allow file's *always* ``entries`` and every live run's approval for each."""
    lasting = app[LASTING]
    if not entries or lasting is None:
        return
    lasting.revoke(entries, by, channel, auth)
    for run in app[RUNS]:
        for entry in entries:
            with contextlib.suppress(RunError):
                run.revoke([entry])


def always_entries(app: web.Application) -> list[dict[str, Any]]:
    """The allow file's standing *always* answers, as ``GET /always`` lists them."""
    lasting = app[LASTING]
    standing = lasting.standing() if lasting is not None else ()
    return [{"entry": a.entry, "at": a.at, "by": a.by, "channel": a.channel, "run": a.run} for a in standing]


async def list_always(request: web.Request) -> web.Response:
    return web.json_response({"always": always_entries(request.app)})


def page_revoke(app: web.Application, run_id: str | None, texts: Sequence[str], by: str, auth: str) -> list[str]:
    """The approvals page's revoke: a run's approvals (``run_id``), or *always* entries (None), recorded as
    ``run.changed`` with the session's ``auth``; RevokeError changes nothing."""
    try:
        if run_id is None:
            lasting = app[LASTING]
            standing = {a.entry for a in lasting.standing()} if lasting is not None else set()
            if not set(texts) <= standing:
                raise RevokeError("no standing always entry for it")
            take_back_always(app, texts, by=by, channel="web", auth=auth)
            revoked, always = [], list(texts)
        else:
            run = app[RUNS].get(run_id)
            if run is None:
                raise RevokeError(f"no live run {run_id}")
            revoked, always = run.revoke(texts), []
    except (RunError, LastingError) as exc:
        raise RevokeError(str(exc)) from None
    record = run_changed_record(ts=time.time(), run=run_id, revoked=revoked, always_revoked=always, auth=auth)
    _write_audit(app, record)
    return revoked + always


async def set_command(request: web.Request) -> web.Response:
    run = _run(request)
    command = (await _body(request)).get("command")
    if command is not None and not isinstance(command, str):
        raise json_error(400, "command must be a string or null")
    run.set_command(command)
    return web.json_response({"id": run.id, "command": run.command})


async def run_events(request: web.Request) -> web.Response:
    run = _run(request)
    try:
        cursor = int(request.query.get("cursor", "0"))
    except ValueError:
        raise json_error(400, "cursor must be an integer") from None
    events, cursor = run.events_after(cursor)
    return web.json_response({"events": events, "cursor": cursor})


async def run_ca(request: web.Request) -> web.Response:
    """``GET /runs/{id}/ca``: the run's inspection CA certificate, PEM (never its key).

    The global token, or the run's own (its launcher's: a sandbox holds neither), for a launcher
    that installs it where the run's clients look (``egressd run`` does it itself).
    """
    run = _run(request)
    inspector = request.app[INSPECTOR]
    if inspector is None or not run.inspected_names():
        raise json_error(404, f"run {run.id} inspects no names (no request rule names a method or a path)")
    return web.Response(body=inspector.certificate_pem(run), content_type="application/x-pem-file")


async def end_run(request: web.Request) -> web.Response:
    run = _run(request)
    try:
        request.app[RUNS].end(run.id)
    except RunError as exc:
        raise json_error(404, str(exc)) from None
    inspector = request.app[INSPECTOR]
    if inspector is not None:
        inspector.forget(run.id)  # its CA goes: no leaf is minted for it again
    request.app[RECORDER].flush_suppressed(run.id)  # what was counted in the run comes before its end
    now = time.time()
    _write_audit(request.app, run_record("run.end", ts=now, run=run.id, **run.summary(now)))
    return web.json_response({"id": run.id, "ended": True})


def build_app(
    *,
    recorder: Recorder,
    screen: Screen,
    runs: RunRegistry,
    proxy_address: tuple[str, int],
    token: str,
    inspector: Inspector | None = None,
    placeholders: Mapping[str, str] | None = None,
    lasting: Lasting | None = None,
    more_metrics: Callable[[], Awaitable[list[tuple[Metrics, int]]]] | None = None,
) -> web.Application:
    """The control application; the caller may add routes, then serves it.

    ``placeholders``: the declared secrets' placeholders by name, handed to whoever creates a run.
    """
    app = web.Application(middlewares=[_require_token], client_max_size=1024 * 1024)
    app[INSPECTOR] = inspector
    app[LASTING] = lasting
    app[MORE_METRICS] = more_metrics
    app[SECRETS] = dict(placeholders or {})
    app[RECORDER] = recorder
    app[SCREEN] = screen
    app[RUNS] = runs
    app[PROXY_ADDRESS] = proxy_address
    app[TOKEN] = token
    app[PUBLIC_PATHS] = {"/health"}
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/runs", list_runs)
    app.router.add_post("/runs", create_run)
    app.router.add_get("/runs/{run_id}", get_run)
    app.router.add_patch("/runs/{run_id}", change_run)
    app.router.add_get("/always", list_always)
    app.router.add_put("/runs/{run_id}/command", set_command)
    app.router.add_get("/runs/{run_id}/events", run_events)
    app.router.add_delete("/runs/{run_id}", end_run)
    app.router.add_get("/runs/{run_id}/ca", run_ca)
    # What the approvals page (``--approver web``) reads: sign-in, runs, egress records.
    app[CONTROL_VIEW] = ControlView(
        sign_in=lambda given: token_scope(app, given),
        runs=lambda: [run.describe() for run in runs],
        recent=lambda n: recent_events(runs, n),
        observers=recorder.observers,
        always=lambda: always_entries(app),
        revoke=lambda run_id, texts, by, auth: page_revoke(app, run_id, texts, by, auth),
    )
    return app


def recent_events(runs: RunRegistry, n: int) -> list[dict[str, Any]]:
    """The last ``n`` egress records of every live run together, oldest first (from their event windows)."""
    picked: list[dict[str, Any]] = []
    for run in runs:
        picked.extend(record for _, record in itertools.islice(reversed(run.events), n))
    picked.sort(key=lambda record: record.get("ts") or 0.0)
    return picked[-n:]
