"""The dashboard's pure parts: the SVG charts, the outcome counter, the session helpers."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import cast

from jsqueue.admin import Admin
from jsqueue.envelope import utcnow
from jsqueue.events import Event, EventKind
from jsqueue.ui.charts import bar_chart, line_chart
from jsqueue.ui.history import DepthHistory, OutcomeCounter, Sampling
from jsqueue.ui.pages import age
from jsqueue.ui.session import csrf_token
from support.queue import eventually


def test_charts_escape_labels_and_scale() -> None:
    svg = line_chart({"<b>evil</b>": [0.0, 5.0, 10.0]}, ("a&b", "z"), 'title "x"')
    assert "<b>" not in svg and "&lt;b&gt;evil&lt;/b&gt;: 10" in svg
    assert "a&amp;b" in svg and "title &quot;x&quot;" in svg
    assert svg.count("<polyline") == 1
    # the largest value reaches the top of the plot (y = top padding), zero the bottom
    points = svg.split('points="')[1].split('"')[0].split()
    assert points[-1].endswith(",8.0") and points[0].endswith(",158.0")
    one = line_chart({"s": [3.0]}, ("", ""), "t")
    assert "<circle" in one and "<polyline" not in one
    bars = bar_chart([{"delivered": 2, "bounced": 1}, {}], ["delivered", "bounced"], ("", ""), "t")
    assert bars.count("<rect") == 2 and "delivered: 2" in bars


def test_outcome_counter_counts_per_minute_once_and_forgets_old_minutes() -> None:
    c = OutcomeCounter(minutes=5)
    now = utcnow()
    e = Event(kind=EventKind.DELIVERED, queue_id="q", at=now)
    c.count(e)
    c.count(e)  # the same event again (a reconnect starting earlier)
    c.count(Event(kind=EventKind.DEFERRED, queue_id="q", at=now))
    c.count(Event(kind=EventKind.HELD, queue_id="q", at=now))  # not an outcome
    c.count(Event(kind=EventKind.BOUNCED, queue_id="q", at=now - timedelta(minutes=10)))
    assert c.totals(1, now) == {
        EventKind.DELIVERED: 1,
        EventKind.DEFERRED: 1,
        EventKind.BOUNCED: 0,
        EventKind.EXPIRED: 0,
    }
    series = c.series(now)
    assert len(series) == 5 and series[-1][0] == now.replace(second=0, microsecond=0)
    assert all(m >= now - timedelta(minutes=5) for m in c.buckets)


def test_age_and_csrf() -> None:
    assert age(None) == "-" and age(12.7) == "12s" and age(250) == "4m 10s"
    assert age(2 * 86400 + 3 * 3600 + 5) == "2d 3h"
    assert csrf_token("jsq_a") != csrf_token("jsq_b")
    assert len(csrf_token("jsq_a")) == 64


class _IdleHistory(DepthHistory):
    """A depth ring whose run only waits for its stop (no store is read)."""

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()


async def test_sampling_runs_until_its_last_task_has_ended() -> None:
    """Once the dashboard is not viewed for ``idle_s`` the work stops; ``running`` stays
    true until every one of its tasks has ended (a follower takes a moment to close its
    events subscription), so whoever sees it false sees no task left behind."""
    cancelled, release = asyncio.Event(), asyncio.Event()

    async def follow() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            await release.wait()  # closing the subscription
            raise

    history = _IdleHistory(cast(Admin, None), interval_s=1.0, keep=1)
    sampling = Sampling(history, OutcomeCounter(minutes=1), follow, idle_s=0.01)
    sampling.viewed()
    assert sampling.running
    await asyncio.wait_for(cancelled.wait(), 5)  # the idle timer stopped the work
    assert sampling.running  # the follower has not ended yet
    release.set()
    await eventually(lambda: not sampling.running, what="the work ended")
    left = {t.get_name() for t in asyncio.all_tasks()}
    assert not {n for n in left if n.startswith("jsqueue-ui-")}
    sampling.viewed()  # viewed again: a fresh start
    assert sampling.running and sampling.starts == 2
    await sampling.close()
    assert not sampling.running
