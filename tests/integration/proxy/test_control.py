"""The control API over a real socket: token, health, metrics, runs, events."""

from __future__ import annotations

import base64

import aiohttp

from tests.harness import connect_via, open_proxy, read_response, wait_until

AUTH = {"Authorization": "Bearer test-token"}


async def test_health_needs_no_token_but_everything_else_does(make_egressd) -> None:
    svc = await make_egressd()
    async with aiohttp.ClientSession(svc.control_address) as http:
        async with http.get("/health") as resp:
            assert resp.status == 200 and (await resp.json())["audit"] is True
        for path in ("/metrics", "/runs"):
            async with http.get(path) as resp:
                assert resp.status == 401
            async with http.get(path, headers={"Authorization": "Bearer wrong"}) as resp:
                assert resp.status == 401


async def test_a_run_created_through_the_api_gets_credentials_that_work(make_egressd, echo_origin) -> None:
    svc = await make_egressd(require_auth=True)
    async with aiohttp.ClientSession(svc.control_address, headers=AUTH) as http:
        async with http.post("/runs", json={"task": "echo things", "allow": ["origin.test:*"]}) as resp:
            assert resp.status == 201
            created = await resp.json()
        assert created["proxy_url"].startswith(f"http://{created['id']}:{created['token']}@127.0.0.1:")
        async with http.put(f"/runs/{created['id']}/command", json={"command": "nc origin.test"}) as resp:
            assert resp.status == 200

        creds = base64.b64encode(f"{created['id']}:{created['token']}".encode()).decode()
        status, _, _, reader, writer = await connect_via(
            svc, f"origin.test:{echo_origin.port}", f"Proxy-Authorization: Basic {creds}\r\n"
        )
        assert status == 200
        writer.close()
        await wait_until(lambda: len(svc.runs.get(created["id"]).events) == 1)  # written when the tunnel ends
        status, _, _, _, w = await connect_via(svc, "leak.test:443", f"Proxy-Authorization: Basic {creds}\r\n")
        w.close()
        assert status == 403

        async def events() -> dict:  # type: ignore[type-arg]
            async with http.get(f"/runs/{created['id']}/events", params={"cursor": "0"}) as resp:
                return await resp.json()  # type: ignore[no-any-return]

        await wait_until(lambda: len(svc.runs.get(created["id"]).events) == 2)
        page = await events()
        assert [e["decision"] for e in page["events"]] == ["allow", "deny"]
        assert page["events"][0]["command"] == "nc origin.test"
        async with http.get(f"/runs/{created['id']}/events", params={"cursor": str(page["cursor"])}) as resp:
            assert (await resp.json())["events"] == []

        async with http.get("/runs") as resp:
            listed = await resp.json()
        assert [r["id"] for r in listed["runs"]] == [created["id"]]
        assert "token" not in str(listed)

        async with http.delete(f"/runs/{created['id']}") as resp:
            assert resp.status == 200
        async with http.get(f"/runs/{created['id']}") as resp:
            assert resp.status == 404
    events_logged = [r["event"] for r in svc.audit_records]
    assert "run.start" in events_logged and "run.end" in events_logged
    assert created["token"] not in str(svc.audit_records)


async def test_bad_run_requests_get_clear_errors(make_egressd) -> None:
    svc = await make_egressd()
    async with aiohttp.ClientSession(svc.control_address, headers=AUTH) as http:
        for body, fragment in [
            ({"allow": ["*.com"]}, "allow"),
            ({"allow": "example.com"}, "list"),
            ({"preset": ["nope"]}, "nope"),
            ({"sources": ["not-an-ip"]}, "sources"),
        ]:
            async with http.post("/runs", json=body) as resp:
                assert resp.status == 400
                assert fragment in (await resp.json())["error"]
        async with http.post("/runs", data=b"{not json") as resp:
            assert resp.status == 400


async def test_source_address_binding_attributes_without_credentials(make_egressd, http_origin) -> None:
    svc = await make_egressd(require_auth=True)
    async with aiohttp.ClientSession(svc.control_address, headers=AUTH) as http:
        async with http.post("/runs", json={"allow": ["origin.test:*"], "sources": ["127.0.0.1"]}) as resp:
            run_id = (await resp.json())["id"]
        async with http.post("/runs", json={"sources": ["127.0.0.1"]}) as resp:
            assert resp.status == 409
    reader, writer = await open_proxy(svc)
    writer.write(f"GET http://origin.test:{http_origin.port}/ HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
    status, _, _ = await read_response(reader)
    writer.close()
    assert status == 200
    assert svc.runs.get(run_id).events[0][1]["run"] == run_id


async def test_metrics_count_decisions(make_egressd) -> None:
    svc = await make_egressd(ask=False)
    status, _, _, _, w = await connect_via(svc, "leak.test:443")
    w.close()
    async with aiohttp.ClientSession(svc.control_address, headers=AUTH) as http:
        async with http.get("/metrics") as resp:
            text = await resp.text()
    assert 'egressd_decisions_total{decision="deny",reason="not_allowlisted"} 1' in text
    assert "egressd_audit_healthy 1" in text


async def test_generated_control_tokens_never_start_with_a_dash(make_egressd, tmp_path, monkeypatch) -> None:
    # `--control-token "$TOKEN"` cannot parse a token starting with '-' (one in 64 did, base64url).
    from egressd.proxy.core.runs import new_control_token

    tokens = [new_control_token() for _ in range(2000)]
    assert all(len(t) == 64 and t.strip("0123456789abcdef") == "" for t in tokens)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))  # where the generated token's file goes
    svc = await make_egressd(control_token=None, require_auth=True)
    assert not svc.control_token.startswith("-") and len(svc.control_token) == 64
    run = svc.runs.create(task="t", allow=[], deny=[], ask=False, sources=[])
    assert not run.control_token.startswith("-")
