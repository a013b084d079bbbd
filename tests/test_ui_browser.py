"""The dashboard end to end in headless Chromium (Debian's ``/usr/bin/chromium``, driven by
Playwright; Playwright's own browsers are never used): log in with a token, load the
overview, search a message, open it, flush it, see its state change. A screenshot of
every page goes to the test's output folder (``tmp_path/screens``; the README's
docs/img/dashboard.png is the overview of a run).

The queue is real (nats-server, SMTP front end, worker, scripted MXes, DNS on loopback:
tests/support/ui.py); the browser reaches the dashboard on 127.0.0.1 only, with every
background network feature of Chromium off.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import BrowserContext, Page, async_playwright, expect

from jsqueue.envelope import EntryState
from support.queue import eventually
from support.ui import UiEnv

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SHOTS = ["1-login", "2-overview", "3-search", "4-message", "5-confirm", "6-flushed"]
#: Set to a folder to keep the screenshots of a run there too (the README's picture).
SCREENS_ENV = "JSQUEUE_UI_SCREENSHOTS"


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[BrowserContext]:
    """Chromium with a fresh profile in ``tmp_path``; closed at teardown."""
    assert os.access(CHROMIUM, os.X_OK), "Debian's chromium is missing: run `make tools`"
    async with async_playwright() as p:
        context = await p.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=ARGS,
            viewport={"width": 1200, "height": 900},
        )
        try:
            yield context
        finally:
            await context.close()


@pytest.fixture
def screens(tmp_path: Path) -> Path:
    """The test's screenshot folder (its output folder)."""
    folder = tmp_path / "screens"
    folder.mkdir()
    return folder


async def shot(page: Page, folder: Path, name: str) -> None:
    """A full-page screenshot of ``page`` as ``folder/name.png`` (and in $SCREENS_ENV)."""
    await page.screenshot(path=str(folder / f"{name}.png"), full_page=True)
    _keep(folder / f"{name}.png")


def _keep(png: Path) -> None:
    keep = os.environ.get(SCREENS_ENV)
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(png, Path(keep) / png.name)


async def test_login_overview_search_open_flush(
    ui_env: UiEnv, browser: BrowserContext, screens: Path
) -> None:
    env = ui_env
    # some traffic for the overview: delivered, bounced, deferred
    for i in range(3):
        await env.submit(f"user{i}@ok.example.test", i)
    await env.submit("x@bad.example.test", 10)
    others = [await env.submit(f"other{i}@slow.example.test", 20 + i) for i in range(2)]
    target = await env.submit("target@slow.example.test", 30)

    async def deferred() -> bool:
        e = await env.harness.entry(target)
        return e is not None and e.state is EntryState.DEFERRED

    await eventually(deferred, what="the target deferred by its MX's 450")
    await eventually(lambda: len(env.ok.delivered) == 3, what="three delivered")
    assert others

    page = await browser.new_page()
    await page.goto(env.url + "/ui/")
    await expect(page).to_have_url(env.url + "/ui/login?next=%2Fui%2F")
    await shot(page, screens, "1-login")
    await page.fill("#token", env.tokens["admin"])
    await page.click("button[type=submit]")
    await expect(page.locator("h1")).to_have_text("Overview")

    # the sampler runs every 0.3 s; reload until its sample shows the three deferred
    async def overview_ready() -> bool:
        await page.reload()
        return (await page.locator("#state-deferred").text_content() or "") == "3"

    await eventually(overview_ready, what="the overview's sample")
    await eventually(
        lambda: _text(page, "#minute-delivered"), what="outcomes counted from the events"
    )
    await page.reload()
    await expect(page.locator("#queued")).to_have_text("3")
    await expect(page.locator("svg.chart").first).to_be_visible()
    await shot(page, screens, "2-overview")

    await page.click("nav >> text=Queue")
    await page.fill("input[name=recipient]", "target@slow")
    await page.click("form.search button")
    rows = page.locator("table.entries tbody tr")
    await expect(rows).to_have_count(1)
    await expect(rows.first).to_contain_text("target@slow.example.test")
    await shot(page, screens, "3-search")

    await page.click(f"a[href='/ui/queue/{target}']")
    await expect(page.locator("#entry-state")).to_have_text("deferred")
    await expect(page.locator("table.history")).to_contain_text("450 4.2.0")
    # the TLS policy of the session that gave the reply (the scripted MX offers no STARTTLS)
    await expect(page.locator("table.history")).to_contain_text("opportunistic: no TLS")
    await shot(page, screens, "4-message")

    env.slow.rcpt = "250 2.1.5 ok"  # the MX takes it now: a flush delivers it
    await page.click("a.action-flush")
    await expect(page.locator("h1")).to_contain_text("Flush")
    await shot(page, screens, "5-confirm")
    await page.click("#confirm")
    await expect(page.locator(".flash")).to_contain_text("flush: done")

    async def delivered() -> bool:
        await page.reload()
        return "delivered" in (await page.locator("table.history").text_content() or "")

    await eventually(delivered, what="the flushed message delivered")
    await expect(page.locator("#entry-state")).not_to_have_text("deferred")
    await expect(page.locator("table.history")).to_contain_text("flushed")
    await shot(page, screens, "6-flushed")
    assert any(t.rcpt_to == ["target@slow.example.test"] for t in env.slow.delivered)
    assert sorted(os.listdir(screens)) == [f"{n}.png" for n in SHOTS]


async def _text(page: Page, selector: str) -> bool:
    await page.reload()
    return (await page.locator(selector).text_content() or "0") != "0"
