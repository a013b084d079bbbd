"""The dashboard over real HTTP on loopback (aiohttp's client, a real cookie jar): login and
its cookie, roles, CSRF, the list's filters and the message page, against a real queue
(nats-server, front end, worker, scripted MXes). The browser test is test_ui_browser.py."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from jsqueue.config import DestinationSettings
from jsqueue.envelope import EntryState
from jsqueue.events import NULL_OBSERVER
from jsqueue.http.auth import TokenFile
from jsqueue.http.context import ApiContext
from jsqueue.names import slot_key
from jsqueue.ui.app import Dashboard
from jsqueue.ui.pages import destination_rows
from jsqueue.ui.session import COOKIE, csrf_token
from support.queue import eventually
from support.ui import UiEnv


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    # unsafe=True: the jar keeps cookies of an IP-address host (127.0.0.1)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        yield s


async def login(env: UiEnv, client: aiohttp.ClientSession, role: str) -> aiohttp.ClientResponse:
    async with client.post(
        env.url + "/ui/login",
        data={"token": env.tokens[role], "next": "/ui/queue"},
        allow_redirects=False,
    ) as r:
        await r.read()
        return r


async def get(client: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with client.get(url, allow_redirects=False) as r:
        return r.status, await r.text()


async def test_login_cookie_and_refusals(ui_env: UiEnv, client: aiohttp.ClientSession) -> None:
    status, _ = await get(client, ui_env.url + "/ui/")
    assert status == 302, "no cookie: to the login form"
    async with client.get(ui_env.url + "/ui/", allow_redirects=False) as r:
        assert r.headers["Location"].startswith("/ui/login?next=")
    for bad in ("jsq_unknown", ui_env.tokens["inject"]):
        async with client.post(ui_env.url + "/ui/login", data={"token": bad}) as r:
            assert r.status == 401
            assert "cannot see the queue" in await r.text() or bad == "jsq_unknown"
    assert not client.cookie_jar.filter_cookies(ui_env.url + "/ui/")

    r = await login(ui_env, client, "read")
    assert r.status == 302 and r.headers["Location"] == "/ui/queue"
    header = r.headers["Set-Cookie"]
    assert header.startswith(f"{COOKIE}=")
    assert "HttpOnly" in header and "SameSite=Strict" in header and "Path=/ui/" in header
    status, html = await get(client, ui_env.url + "/ui/")
    assert status == 200 and "Overview" in html
    async with client.get(ui_env.url + "/ui/") as r:
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
        assert r.headers["Cache-Control"] == "no-store"

    # an open redirect is refused: next must be a dashboard path
    async with client.post(
        ui_env.url + "/ui/login",
        data={"token": ui_env.tokens["read"], "next": "https://elsewhere.example/"},
        allow_redirects=False,
    ) as r:
        assert r.headers["Location"] == "/ui/"
    # nor a header split (the login form's next comes from its query): a CR LF, a space
    # or a non-ASCII character is no URI (RFC 3986 §2), and the answer a redirect, not 500
    for target in ("/ui/queue\r\nSet-Cookie: x=1", "/ui/queue x", "/ui/queue?sender=é"):
        async with client.post(
            ui_env.url + "/ui/login",
            data={"token": ui_env.tokens["read"], "next": target},
            allow_redirects=False,
        ) as r:
            assert r.status == 302 and r.headers["Location"] == "/ui/", target


async def test_read_token_sees_no_action_and_gets_403(
    ui_env: UiEnv, client: aiohttp.ClientSession
) -> None:
    qid = await ui_env.submit("r1@slow.example.test")
    await eventually(
        lambda: _state_is(ui_env, qid, EntryState.DEFERRED), what="deferred by the 450"
    )
    await login(ui_env, client, "read")
    status, html = await get(client, f"{ui_env.url}/ui/queue/{qid}")
    assert status == 200 and "r1@slow.example.test" in html
    assert "450 4.2.0" in html, "the attempt's reply is in the history"
    assert 'class="actions"' not in html and "/flush" not in html
    status, _ = await get(client, f"{ui_env.url}/ui/queue/{qid}/flush")
    assert status == 403
    csrf = csrf_token(ui_env.tokens["read"])
    async with client.post(f"{ui_env.url}/ui/queue/{qid}/delete", data={"csrf": csrf}) as r:
        assert r.status == 403
    assert await ui_env.harness.entry(qid) is not None, "nothing was deleted"


async def test_actions_need_the_csrf_token(ui_env: UiEnv, client: aiohttp.ClientSession) -> None:
    qid = await ui_env.submit("r2@slow.example.test")
    await eventually(lambda: _state_is(ui_env, qid, EntryState.DEFERRED), what="deferred")
    await login(ui_env, client, "admin")
    url = f"{ui_env.url}/ui/queue/{qid}/hold"
    status, html = await get(client, url)
    assert status == 200 and "Yes, hold" in html
    csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', html)
    assert csrf is not None
    for data in ({}, {"csrf": "0" * 64}):
        async with client.post(url, data=data, allow_redirects=False) as r:
            assert r.status == 403
    async with client.post(
        url, data={"csrf": csrf[1]}, headers={"Origin": "http://evil.example"}
    ) as r:
        assert r.status == 403, "another origin"
    entry = await ui_env.harness.entry(qid)
    assert entry is not None and not entry.held
    async with client.post(url, data={"csrf": csrf[1]}, allow_redirects=False) as r:
        assert r.status == 303
        assert r.headers["Location"].startswith(f"/ui/queue/{qid}?did=hold&outcome=done")
    entry = await ui_env.harness.entry(qid)
    assert entry is not None and entry.held
    status, html = await get(client, f"{ui_env.url}/ui/queue/{qid}")
    assert "ui:t-admin" in html, "the action's event names the token"


async def test_list_filters_and_paging(ui_env: UiEnv, client: aiohttp.ClientSession) -> None:
    ids = [await ui_env.submit(f"p{i}@slow.example.test", i) for i in range(3)]
    ids.append(await ui_env.submit("x@bad.example.test", 9))
    await eventually(lambda: _state_is(ui_env, ids[2], EntryState.DEFERRED), what="deferred")
    await login(ui_env, client, "read")
    base = ui_env.url + "/ui/queue"
    status, html = await get(client, base + "?recipient=P1@SLOW")
    assert status == 200 and ids[1] in html and ids[0] not in html and ids[2] not in html
    status, html = await get(client, base + "?domain=slow.example.test&state=deferred")
    assert all(i in html for i in ids[:3])
    status, html = await get(client, base + "?domain=not_a_domain!")
    assert status == 422 and "domain: " in html
    # a stale bookmark or a hand-edited query: 422 naming the field and the values, not 500
    for state in ("queued", "DONE", "done%00", "%ff", "x" * 300):
        status, html = await get(client, base + f"?state={state}&domain=slow.example.test")
        assert status == 422, (state, html[:200])
        assert "state: Input should be &#39;held&#39;, &#39;active&#39;" in html, html
    status, html = await get(client, base + "?state=queued&domain=not_a_domain!")
    assert status == 422 and "state: " in html and "domain: " in html
    status, html = await get(client, base + "?sender=nobody@example.test")
    assert "No entry matches." in html
    status, _ = await get(client, base + f"?id={ids[0]}")
    assert status == 302
    status, html = await get(client, base + f"?domain=slow.example.test&after={ids[0]}")
    assert ids[0] not in html and ids[1] in html


async def _state_is(env: UiEnv, qid: str, state: EntryState) -> bool:
    entry = await env.harness.entry(qid)
    return entry is not None and entry.state is state


async def test_destinations_from_the_bucket_and_none_without_a_hook(
    ui_env: UiEnv, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """The dashboard's destinations page reads the destinations bucket (what ``dest ls``
    shows, cluster-wide); without the hook (destination limits off) there is no page."""
    h = ui_env.harness
    assert h.stores.destinations is not None
    owner = {"owner": "w-elsewhere", "at": 0.0}
    await h.stores.destinations.put(slot_key("seeded.example.test", 0), owner, revision=0, ttl_s=60)
    await login(ui_env, client, "read")
    status, html = await get(client, ui_env.url + "/ui/")
    assert status == 200 and 'href="/ui/destinations"' in html
    status, html = await get(client, ui_env.url + "/ui/destinations")
    assert status == 200 and "seeded.example.test" in html and "<td>up</td>" in html

    off = h.settings.model_copy(update={"destinations": DestinationSettings(enabled=False)})
    assert destination_rows(off, h.stores) is None
    ctx = ApiContext(
        h.settings,
        h.stores,
        list(h.settings.nats.urls),
        NULL_OBSERVER,
        TokenFile(tmp_path / "tokens"),
    )
    async with (
        serving(Dashboard(ctx, None)) as base,
        aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other,
    ):
        async with other.post(base + "/ui/login", data={"token": ui_env.tokens["read"]}) as r:
            assert r.status == 200
            assert 'href="/ui/destinations"' not in await r.text()
        status, html = await get(other, base + "/ui/destinations")
        assert status == 404


@contextlib.asynccontextmanager
async def serving(dashboard: Dashboard) -> AsyncIterator[str]:
    """``dashboard`` alone on an HTTP endpoint of its own on 127.0.0.1; yields its URL."""
    app = web.Application()
    dashboard.mount(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_overview_samples_only_while_viewed(ui_env: UiEnv, tmp_path: Path) -> None:
    """The depth sampler and the events follower start with the first page view and stop
    ``ui.idle_s`` after the last one: a process whose dashboard nobody opens reads no entry
    and no event for it (each pod of a deployment serves the dashboard)."""
    h = ui_env.harness
    await ui_env.submit("x@bad.example.test")  # a bounce: one outcome for the counter
    settings = h.settings.model_copy(
        update={"ui": h.settings.ui.model_copy(update={"idle_s": 1.0, "sample_interval_s": 0.2})}
    )
    tokens = TokenFile(tmp_path / "tokens")  # ui_env's
    ctx = ApiContext(settings, h.stores, list(settings.nats.urls), NULL_OBSERVER, tokens)
    dashboard = Dashboard(ctx, None)
    async with (
        serving(dashboard) as base,
        aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as c,
    ):
        async with c.get(base + "/ui/login") as r:  # the login form is not a view
            assert r.status == 200
        assert not dashboard.sampling.running and dashboard.sampling.starts == 0
        assert list(dashboard.history.samples) == []

        async with c.post(base + "/ui/login", data={"token": ui_env.tokens["read"]}) as r:
            assert r.status == 200  # redirected to a page: the first view
        assert dashboard.sampling.running and dashboard.sampling.starts == 1
        await eventually(lambda: bool(dashboard.history.samples), what="a depth sample")
        await eventually(
            lambda: dashboard.outcomes.seen == 2, what="the bounce and its DSN's delivery"
        )

        await eventually(lambda: not dashboard.sampling.running, what="stopped when idle")
        assert _ui_tasks() == set()  # sampler, follower and idle timer all ended

        status, _ = await get(c, base + "/ui/")  # viewed again: a fresh start
        assert status == 200
        assert dashboard.sampling.running and dashboard.sampling.starts == 2
        await eventually(lambda: bool(dashboard.history.samples), what="sampling again")
        # the counts start afresh and are read again from the events stream: not doubled
        await eventually(lambda: dashboard.outcomes.seen == 2, what="outcomes read again")
    assert not dashboard.sampling.running


def _ui_tasks() -> set[str]:
    """Names of the dashboard's background tasks still running in this loop."""
    return {n for t in asyncio.all_tasks() if (n := t.get_name()).startswith("jsqueue-ui-")}
