"""Destination limits: the pure arithmetic of :mod:`jsqueue.limits` (sites, GCRA, throttle
feedback, dead sites per RFC 5321 §4.5.4.1, throttle replies per RFC 5321 §4.2.2 / §4.5.3.2)
and :class:`jsqueue.destinations.Destinations` over the in-memory destinations store (the
same compare-and-set and TTL semantics as the JetStream bucket; the real-process tests are
in ``tests/test_destinations.py``)."""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import pytest

from jsqueue import destinations, limits
from jsqueue.admission import site_down_reply
from jsqueue.config import DestinationSettings, Settings, parse_rate
from jsqueue.delivery.base import Attempt
from jsqueue.destinations import FULL_MEMO_S, Destinations
from jsqueue.errors import StoreUnavailable, TemporaryDeliveryError
from jsqueue.events import Event, EventKind
from jsqueue.limits import SiteState, SiteStatus
from jsqueue.names import key_token, site_key, site_of_key, slot_key, token_text
from jsqueue.replies import R451_CONNECT_FAILED, Reply
from jsqueue.site_view import SiteView
from jsqueue.store.base import Keyed, Stores
from jsqueue.store.memory import MemoryDestinations

# --------------------------------------------------------------------------- sites


def test_site_is_the_domain_by_default() -> None:
    assert limits.site_for("Example.COM", ["mx.example.com"], {}) == "example.com"


def test_site_groups_domains_by_mx_host_pattern() -> None:
    groups = {"big": ["*.big-mail.example", "*.bigmail.example"], "ms": ["*.office.example"]}
    assert limits.site_for("corp.test", ["aspmx.l.big-mail.example."], groups) == "big"
    assert limits.site_for("other.test", ["mx1.Office.example"], groups) == "ms"
    assert limits.site_for("mail.test", [], {"g": ["mail.test"]}) == "g"  # the domain itself
    assert limits.site_for("plain.test", ["mx.plain.test"], groups) == "plain.test"


def test_site_names_are_kv_key_tokens_and_back() -> None:
    for site in ("mail.example.com", "a=b", "ümlaut.test", "[127.0.0.1]"):
        token = key_token(site)
        assert all(c.isalnum() or c in "-_=" for c in token)
        assert token_text(token) == site
        assert site_of_key(slot_key(site, 3)) == ("slot", site)


# --------------------------------------------------------------------------- GCRA


def test_gcra_allows_rate_per_interval_and_no_more() -> None:
    """10 per second, burst 1: over any window of w seconds at most w/T + 1 pass."""
    tat: float | None = None
    allowed = []
    for i in range(1000):  # every 10 ms for 10 s
        now = 1000.0 + i * 0.01
        step = limits.gcra(tat, now, 10, 1.0)
        if step.allowed:
            tat = step.tat_s
            allowed.append(now)
    assert 100 <= len(allowed) <= 101
    gaps = [b - a for a, b in itertools.pairwise(allowed)]
    assert min(gaps) >= 0.1 - 1e-6


def test_gcra_burst_and_wait() -> None:
    step = limits.gcra(None, 0.0, 60, 60.0, burst=3)
    tat = step.tat_s
    for _ in range(2):
        step = limits.gcra(tat, 0.0, 60, 60.0, burst=3)
        assert step.allowed
        tat = step.tat_s
    refused = limits.gcra(tat, 0.0, 60, 60.0, burst=3)
    assert not refused.allowed and refused.wait_s == pytest.approx(1.0)
    assert refused.tat_s == tat  # a refusal stores nothing new
    assert limits.gcra(tat, 1.0, 60, 60.0, burst=3).allowed


def test_gcra_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        limits.gcra(None, 0.0, 0, 1.0)


def test_rates_parse() -> None:
    assert parse_rate("100/m") == (100, 60.0)
    assert parse_rate("30/10s") == (30, 10.0)
    assert parse_rate(" 5 / s ") == (5, 1.0)
    for bad in ("100", "0/m", "1/0s", "x/m", "5/d"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_rate_settings_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="message_rate"):
        Settings(destinations={"message_rate": "fast"})  # type: ignore[arg-type]
    d = DestinationSettings(message_rate="off", site_message_rates={"a.test": "10/m"})
    assert d.message_rate_of("b.test") is None and d.message_rate_of("a.test") == (10, 60.0)


# --------------------------------------------------------------------------- dead sites


def test_dead_site_after_threshold_and_cool_off() -> None:
    """RFC 5321 §4.5.4.1: after ``dead_after`` consecutive connection failures the site is
    down for the cool-off; then one probe; an answer clears it."""
    st = SiteState()
    for i in range(2):
        st = limits.after_failure(st, 100.0 + i, threshold=3, cool_off_s=60)
        assert limits.status(st, 101.0) is SiteStatus.UP
    st = limits.after_failure(st, 102.0, threshold=3, cool_off_s=60)
    assert limits.status(st, 103.0) is SiteStatus.DOWN and st.down_until == 162.0
    assert limits.status(st, 162.0) is SiteStatus.PROBE
    again = limits.after_failure(st, 170.0, threshold=3, cool_off_s=60)  # the probe failed
    assert limits.status(again, 171.0) is SiteStatus.DOWN and again.down_until == 230.0
    assert limits.after_success(again).is_clear


def test_a_site_marked_down_is_down_whatever_the_readers_dead_after() -> None:
    """``dead_after`` is the counting worker's: a site it marked down after 1 failure is
    down for ``dest ls`` run with the default of 5 too (it showed "up", no end)."""
    st = limits.after_failure(SiteState(), 100.0, threshold=1, cool_off_s=600)
    assert st.failures == 1 and limits.status(st, 101.0) is SiteStatus.DOWN


def test_counting_failures_allows_one_session() -> None:
    st = limits.after_failure(SiteState(), 0.0, threshold=5, cool_off_s=60)
    assert limits.allowed_sessions(st, 20, 0.0, 10.0) == 1
    assert limits.allowed_sessions(SiteState(), 20, 0.0, 10.0) == 20


def test_throttle_halves_then_grows_back() -> None:
    """RFC 5321 §4.2.2 / §4.5.3.2: a 421 closes the session; the site gets half the sessions
    for the hold, then one more every ``grow_s``."""
    st = limits.after_throttle(SiteState(), 0.0, current=20, hold_s=60.0)
    assert limits.allowed_sessions(st, 20, 30.0, 10.0) == 10
    assert limits.allowed_sessions(st, 20, 60.5, 10.0) == 11
    assert limits.allowed_sessions(st, 20, 60.0 + 95, 10.0) == 20
    assert limits.throttle_worn_off(st, 20, 60.0 + 95, 10.0)
    assert not limits.throttle_worn_off(st, 20, 61.0, 10.0)
    twice = limits.after_throttle(st, 1.0, current=10, hold_s=60.0)
    assert limits.allowed_sessions(twice, 20, 2.0, 10.0) == 5
    # the 421s of sessions opened together (one burst) halve once
    assert limits.after_throttle(st, 0.5, current=10, hold_s=60.0) == st


async def test_a_throttle_seen_on_a_stale_copy_never_raises_the_limit() -> None:
    """Worker a halved a site twice (8 -> 4 -> 2); worker b, whose copy of the site state
    is older, gets a 421 too. Its compare-and-set fails on the old revision and the
    retry halves the fresh state (2 -> 1). b used to halve its copy's 8 on every retry and
    wrote 4: a throttle reply raised the sessions allowed."""
    store, clock = MemoryDestinations(), _Clock()
    a = _dest(store, clock, sessions=8)
    b = _dest(store, clock, sessions=8, state_refresh_s=3600)
    throttled = Attempt(
        {"a@x.test": Reply(code=421, enhanced="4.7.0", text="too many", remote_host="mx")}, "mx"
    )
    adm = await b.admit("x.test")  # b reads the state (clear) and keeps that copy
    for _ in range(2):
        clock.now += 2 * limits.THROTTLE_BURST_S
        held = await a.admit("x.test")
        await a.done(held, throttled)
    state = SiteState.from_json((await store.get(site_key("x.test"))).value)
    assert state.throttle_limit == 2
    clock.now += 2 * limits.THROTTLE_BURST_S
    await b.done(adm, throttled)
    state = SiteState.from_json((await store.get(site_key("x.test"))).value)
    assert state.throttle_limit == 1


def test_site_state_json_round_trip_and_garbage() -> None:
    st = SiteState(failures=2, down_until=5.0, throttle_limit=3, throttled_until=9.0)
    assert SiteState.from_json(st.to_json()) == st
    assert SiteState.from_json("nonsense").is_clear
    assert SiteState.from_json({"failures": True}).failures == 0


def test_throttle_replies() -> None:
    remote = "mx.example.test"
    assert limits.is_throttle(Reply(code=421, enhanced="4.7.0", text="bye", remote_host=remote))
    assert limits.is_throttle(
        Reply(code=451, enhanced="4.7.1", text="Rate limited, slow down", remote_host=remote)
    )
    assert limits.is_throttle(Reply(code=450, text="Too many connections", remote_host=remote))
    assert not limits.is_throttle(Reply(code=451, text="greylisted", remote_host=remote))
    assert not limits.is_throttle(Reply(code=550, text="rate limit", remote_host=remote))
    assert not limits.is_throttle(Reply(code=421, text="timeout"))  # our own, not the site's


def test_connection_failure_classification() -> None:
    temp, perm = R451_CONNECT_FAILED, Reply(code=554, text="go away", remote_host="mx")
    assert limits.is_connection_failure([temp], reached=False, tried=True)
    assert not limits.is_connection_failure([temp], reached=True, tried=True)
    assert not limits.is_connection_failure([temp], reached=False, tried=False)  # DNS
    assert not limits.is_connection_failure([perm], reached=False, tried=True)
    # a server's own reply at the greeting (too many connections, or a refusal that the
    # session took as temporary) is an answer, not an outage
    greeting = Reply(code=421, enhanced="4.7.0", text="too many connections", remote_host="mx")
    assert not limits.is_connection_failure([greeting], reached=False, tried=True)
    refused = R451_CONNECT_FAILED.model_copy(update={"remote_host": "mx"})
    assert not limits.is_connection_failure([refused], reached=False, tried=True)


def test_site_down_reply_names_site_and_time() -> None:
    from datetime import UTC, datetime

    reply = site_down_reply("example.test", datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    assert (reply.code, reply.enhanced) == (451, "4.4.1")
    assert "site example.test down until 2026-01-02T03:04:05Z" in reply.text


# --------------------------------------------------------------------------- fair shares


def test_site_state_keeps_demand_through_json() -> None:
    st = SiteState(failures=1, demand=(("w0", 12.0), ("w1", 13.5)))
    assert SiteState.from_json(st.to_json()) == st
    assert not SiteState(demand=(("w0", 1.0),)).is_clear  # a demand alone is stored
    odd = SiteState.from_json({"demand": {"w0": "soon", "w1": 3, "w2": True}})
    assert odd.demand == (("w1", 3.0),)
    assert SiteState.from_json({"demand": ["w0"]}).demand == ()


def test_want_writes_at_most_once_per_half_ttl_and_drops_expired_demand() -> None:
    st = limits.want(SiteState(demand=(("old", 99.0),)), "w0", 100.0, 3.0)
    assert st.demand == (("w0", 103.0),)  # the demand that ran out is gone
    assert limits.want(st, "w0", 101.0, 3.0) is st  # 2 s of 3 left: nothing to write
    again = limits.want(st, "w0", 101.6, 3.0)
    assert again.demand == (("w0", 104.6),)
    both = limits.want(again, "w1", 102.0, 3.0)
    assert [o for o, _ in both.demand] == ["w0", "w1"]


def test_fair_share_splits_the_allowed_sessions_between_competing_workers() -> None:
    st = SiteState(demand=(("w1", 110.0), ("w2", 110.0), ("gone", 90.0)))
    assert limits.competing(st, "w0", 100.0) == 3  # itself, w1 and w2; "gone" ran out
    assert limits.competing(st, "w1", 100.0) == 2  # itself (once) and w2
    assert limits.fair_share(20, st, "w0", 100.0) == 7  # rounded up
    assert limits.fair_share(20, SiteState(), "w0", 100.0) == 20  # nobody else wants it
    assert limits.fair_share(2, st, "w0", 100.0) == 1  # at least one
    assert limits.fair_share(20, st, "w0", 111.0) == 20  # every other demand ran out


def test_full_put_back_paces_items_at_the_turnover_rate() -> None:
    """20 units turning over every 0.1 s take an item every 5 ms: a burst of 100 items
    put back is offered again over 0.5 s, each 5 ms after the one before, behind the
    deliveries already waiting; never later than the longest delay."""
    now, paced = 1000.0, 0.0
    offers = []
    for _ in range(100):
        paced = limits.full_put_back(now, paced, 0, 0.1, 20, 30.0)
        offers.append(paced - now)
    assert offers[0] == pytest.approx(0.005)
    assert offers[-1] == pytest.approx(0.5)
    assert all(b - a == pytest.approx(0.005) for a, b in itertools.pairwise(offers))
    behind = limits.full_put_back(now, 0.0, 10, 0.1, 20, 30.0)
    assert behind - now == pytest.approx(0.055)  # after the 10 waiting for a unit here
    assert limits.full_put_back(now, now + 29.99, 0, 0.1, 1, 30.0) == now + 30.0
    assert limits.full_put_back(now, 0.0, 0, 0.1, 0, 30.0) - now == pytest.approx(0.1)


# --------------------------------------------------------------------------- Destinations


class _Events:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _dest(
    store: MemoryDestinations, clock: _Clock, events: _Events | None = None, **kw: object
) -> Destinations:
    settings = DestinationSettings.model_validate(
        {"sessions": 3, "slot_wait_s": 0, "state_refresh_s": 0.001, **kw}
    )
    return Destinations(
        store,
        settings,
        owner=f"w{random.random()}",
        observer=events or _Events(),
        clock=clock,
        rng=random.Random(1),
    )


FAILED = Attempt({"a@x.test": R451_CONNECT_FAILED}, host="mx.x.test")
OK = Attempt({"a@x.test": Reply(code=250, text="ok", remote_host="mx")}, "mx", reached="mx")


async def test_limit_holds_across_two_workers_sharing_the_store() -> None:
    store, clock = MemoryDestinations(), _Clock()
    a, b = _dest(store, clock), _dest(store, clock)
    got = [await a.admit("x.test"), await b.admit("x.test"), await a.admit("x.test")]
    assert all(g.go for g in got)
    refused = await b.admit("x.test")
    assert not refused.go and refused.reason == "full" and refused.delay_s > 0
    assert len(await store.keys("slot.")) == 3
    await a.done(got[0], OK)  # no idle session kept: the slot is not needed any more
    assert len(await store.keys("slot.")) == 3  # kept until the next renewal (no churn)
    await a.renew()  # every slot_ttl_s / 3: unneeded slots go back
    assert len(await store.keys("slot.")) == 2
    await asyncio.sleep(FULL_MEMO_S + 0.1)  # b remembers "full" that long (no scan)
    assert (await b.admit("x.test")).go


class _Unreachable(MemoryDestinations):
    """A destinations bucket whose deletes wait for :attr:`down` and then fail, as a request
    to an unreachable NATS waits out its timeout; :attr:`peak` counts those waiting at once."""

    def __init__(self) -> None:
        super().__init__()
        self.down = asyncio.Event()
        self.waiting = self.peak = 0

    async def delete(self, key: str, *, revision: int | None) -> bool:
        if not self.down.is_set():
            return await super().delete(key, revision=revision)
        self.waiting += 1
        self.peak = max(self.peak, self.waiting)
        await asyncio.sleep(0.2)  # the request timeout
        self.waiting -= 1
        raise StoreUnavailable("no NATS")


async def test_a_worker_stopping_with_nats_down_releases_its_slots_at_once() -> None:
    """Stopping (Destinations.close) releases every slot at the same time: with NATS down
    each release waits out its request timeout, and one after another they kept a
    stopping worker for minutes (20 slots x the timeout and its retries); the slots not
    released expire within slot_ttl_s."""
    store, clock = _Unreachable(), _Clock()
    a = _dest(store, clock, sessions=4)
    assert all([(await a.admit("x.test")).go for _ in range(4)])
    assert (await a.admit("y.test")).go
    store.down.set()
    await a.close()
    assert store.peak == 5, "all five releases were under way at once"
    assert not a._sites["x.test"].slots and not a._sites["y.test"].slots
    await a.close()  # idempotent


async def test_a_delivery_cancelled_in_the_turn_it_is_woken_is_cancelled() -> None:
    """A drain cancels a delivery waiting for a session unit in the same event-loop turn
    as a freed unit wakes it: the cancellation is kept (``asyncio.wait_for`` lost it on
    Python 3.11, and the drained delivery went on to open a session); the wait, woken or
    timed out, leaves no trace."""
    site = SiteView("x.test")
    waiting = asyncio.create_task(site.wait_turn(30))
    await asyncio.sleep(0)  # one turn: the task starts waiting
    assert site.waiters == 1
    site.wake()
    waiting.cancel()
    done, _ = await asyncio.wait({waiting}, timeout=5)
    assert done and waiting.cancelled()
    assert site.waiters == 0 and not site.wakers
    await site.wait_turn(0.01)  # timed out: no error
    assert site.waiters == 0 and not site.wakers


async def test_slot_of_a_dead_worker_expires_by_ttl() -> None:
    store, clock = MemoryDestinations(), _Clock()
    a = _dest(store, clock, sessions=1, slot_ttl_s=2)
    assert (await a.admit("x.test")).go  # a is never heard of again
    b = _dest(store, clock, sessions=1, slot_ttl_s=2)
    assert not (await b.admit("x.test")).go
    await asyncio.sleep(2.3)  # the memory store's TTL runs on the loop's clock
    b._sites["x.test"].full_until = 0
    assert (await b.admit("x.test")).go


async def test_dead_site_defers_without_connecting_then_one_probe() -> None:
    store, clock, events = MemoryDestinations(), _Clock(), _Events()
    a = _dest(store, clock, events, dead_after=2, cool_off_s=60)
    b = _dest(store, clock, dead_after=2, cool_off_s=60)
    for _ in range(2):
        adm = await a.admit("x.test")
        assert adm.go
        await a.done(adm, FAILED)
    assert [e.kind for e in events.events] == [EventKind.SITE_DOWN]
    down = await b.admit("x.test")
    assert not down.go and down.reason == "down" and down.reply is not None
    assert down.reply.enhanced == "4.4.1" and "down until" in down.reply.text
    assert 60 <= down.delay_s <= 60 + 15
    clock.now += 61
    probe = await a.admit("x.test")
    assert probe.go and probe.probe
    waiting = await b.admit("x.test")
    assert not waiting.go and waiting.reason == "probing"
    await a.done(probe, OK)
    assert [e.kind for e in events.events] == [EventKind.SITE_DOWN, EventKind.SITE_UP]
    assert (await b.admit("x.test")).go


async def test_a_down_site_stays_in_the_metrics_for_its_whole_cool_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker forgets a site it has not used for SITE_IDLE_S, unless the site is down:
    ``jsqueue_destination_down`` must say 1 for the whole cool-off (an alert on it used to
    clear itself a minute after the last item was put back); after it, it is forgotten."""
    monkeypatch.setattr(destinations, "SITE_IDLE_S", -1.0)  # every site counts as idle
    store, clock = MemoryDestinations(), _Clock()
    a = _dest(store, clock, dead_after=1, cool_off_s=600)
    await a.done(await a.admit("x.test"), FAILED)
    await a.renew()
    (site,) = a.snapshot()
    assert (site.site, site.status) == ("x.test", SiteStatus.DOWN)
    clock.now += 601  # the cool-off is over: the next item probes it
    await a.renew()
    assert a.snapshot() == []


async def test_an_answer_clears_failures_counted_while_it_was_delivering() -> None:
    """RFC 5321 §4.5.4.1 counts consecutive failures: worker a's delivery gets an answer
    while worker b counts 4 connection failures (dead_after 5). a's success clears them
    (its copy of the state, read at admission, is read again when older than
    state_refresh_s), so b's fifth failure does not take the answering site down. a's old
    copy showed nothing to clear, and the site went down for the cool-off."""
    store, clock, events = MemoryDestinations(), _Clock(), _Events()
    a = _dest(store, clock, events, dead_after=5, sessions=8)
    b = _dest(store, clock, events, dead_after=5, sessions=8)
    delivering = await a.admit("x.test")  # a's copy: no failures
    for _ in range(4):
        await b.done(await b.admit("x.test"), FAILED)
    await asyncio.sleep(0.01)  # a's copy is older than state_refresh_s (1 ms here)
    await a.done(delivering, OK)
    await b.done(await b.admit("x.test"), FAILED)
    state = SiteState.from_json((await store.get(site_key("x.test"))).value)
    assert state.failures == 1 and state.down_until is None
    assert events.events == []


async def test_throttle_reply_lowers_the_limit_for_everyone() -> None:
    store, clock = MemoryDestinations(), _Clock()
    a = _dest(store, clock, sessions=4)
    b = _dest(store, clock, sessions=4)
    adm = await a.admit("x.test")
    throttled = Attempt(
        {"a@x.test": Reply(code=421, enhanced="4.7.0", text="too many", remote_host="mx")},
        "mx",
    )
    await a.done(adm, throttled)
    assert [(await b.admit("x.test")).go for _ in range(3)] == [True, True, False]


@pytest.mark.parametrize(
    "greeting",
    [
        Reply(code=421, enhanced="4.7.0", text="too many connections", remote_host="mx"),
        R451_CONNECT_FAILED.model_copy(update={"remote_host": "mx"}),  # a 554 greeting
    ],
)
async def test_a_greeting_refusal_is_an_answer_not_an_outage(greeting: Reply) -> None:
    """A server that refuses the session at its greeting answered: a 421 (too many
    connections, per client address at Postfix and Exchange) throttles the site (RFC 5321
    §4.2.2), a 554 is retried on its schedule; neither counts towards ``dead_after``
    (§4.5.4.1 is about sites that cannot be reached). Both took the site down before."""
    store, clock, events = MemoryDestinations(), _Clock(), _Events()
    a = _dest(store, clock, events, sessions=8, dead_after=2)
    for _ in range(4):
        adm = await a.admit("x.test")
        assert adm.go
        await a.done(adm, Attempt({"a@x.test": greeting}, "mx.x.test"))
    assert events.events == []
    state = SiteState.from_json((await store.get(site_key("x.test"))).value)
    assert state.failures == 0 and state.down_until is None
    assert (state.throttle_limit is not None) == (greeting.code == 421)


async def test_a_failed_mx_lookup_is_not_kept_as_the_site_of_a_group_member() -> None:
    """Site groups: a domain whose MX lookup fails (SERVFAIL for a moment) is its own site
    for that admission only; the next looks again and its MX hosts put it in its group,
    where the answer is kept. The fallback was kept for ``SITE_NAME_TTL_S`` (5 minutes), in
    which the domain had a limit of its own against the group's MX (18 sessions against
    the group's 2)."""
    answers: list[list[str] | None] = [None, ["mx1.bigmail.test"]]

    async def mx_hosts(domain: str) -> list[str]:
        hosts = answers.pop(0)
        if hosts is None:
            raise TemporaryDeliveryError(Reply(code=451, enhanced="4.4.3", text="SERVFAIL"))
        return hosts

    settings = DestinationSettings.model_validate({"groups": {"big": ["*.bigmail.test"]}})
    dest = Destinations(MemoryDestinations(), settings, owner="w", mx_hosts=mx_hosts)
    assert await dest.site_for("a.test") == "a.test"
    assert await dest.site_for("a.test") == "big"
    assert await dest.site_for("a.test") == "big"  # kept: no third lookup
    assert answers == []


async def test_a_session_opened_beside_an_idle_one_takes_a_connection_token(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``connection_rate`` (1/m here): an admission that counts on an idle cached session
    takes no connection token; when the delivery opens a session after all (the idle one
    was for another MX host, or taken meanwhile), :meth:`Destinations.connecting` takes
    one, and waits for it. Such sessions used to open without any: 14 new connections in
    one second against a rate of 3/s."""
    monkeypatch.setattr(destinations, "CONNECT_WAIT_S", 0.05)
    store, clock = MemoryDestinations(), _Clock()
    a = _dest(store, clock, connection_rate="1/m")
    opened: list[bool] = []
    for _ in range(3):
        a.idle_sessions = lambda site: (1, 0)  # admitted on an idle session
        adm = await a.admit("x.test")
        assert adm.go
        a.idle_sessions = lambda site: (0, 0)  # gone: a session of its own
        caplog.clear()
        await a.connecting("x.test")
        opened.append(not any("over its connection rate" in r.getMessage() for r in caplog.records))
        await a.done(adm, OK)
        clock.now += 30
    assert opened == [True, False, True]  # 0 s, 30 s (too soon: logged), 60 s


async def test_a_worker_keeps_room_for_other_sites() -> None:
    """``max_per_site`` (limits.per_site_cap of worker.concurrency): past it, a site's item
    goes back at once with reason ``capped``, at admission and before its entry is read
    (``early``), while the site has sessions to spare; other sites are admitted. The reason
    is not ``full``: it is a busy site's normal traffic, not its limit."""
    store, clock = MemoryDestinations(), _Clock()
    settings = DestinationSettings.model_validate({"sessions": 8, "slot_wait_s": 0})
    a = Destinations(store, settings, owner="w", clock=clock, max_per_site=2)
    held = [await a.admit("x.test") for _ in range(2)]
    assert all(adm.go for adm in held)
    refused = await a.admit("x.test")
    assert (refused.go, refused.reason) == (False, "capped")
    early = a.early("x.test")
    assert early is not None and early.reason == "capped"
    assert (await a.admit("y.test")).go and a.early("y.test") is None
    await a.done(held[0], OK)
    assert (await a.admit("x.test")).go
    assert limits.per_site_cap(32) == 24 and limits.per_site_cap(4) == 3
    assert limits.per_site_cap(1) == 1


async def test_message_rate_is_shared() -> None:
    store, clock = MemoryDestinations(), _Clock()
    a = _dest(store, clock, sessions=10, message_rate="2/s")
    b = _dest(store, clock, sessions=10, message_rate="2/s")
    first = await a.admit("x.test")
    assert first.go
    second = await b.admit("x.test")
    assert not second.go and second.reason == "rate"
    clock.now += 0.5
    assert (await b.admit("x.test")).go


class _Sessions:
    """The deliverer's connection cache as the destination limits see it: idle sessions
    per site, and the ones it was asked to close (they stay "closing" until
    :meth:`quit_done`)."""

    def __init__(self) -> None:
        self.idle: dict[str, int] = {}
        self.closing: dict[str, int] = {}

    def count(self, site: str) -> tuple[int, int]:
        return self.idle.get(site, 0), self.closing.get(site, 0)

    def shed(self, site: str, n: int) -> None:
        n = min(n, self.idle.get(site, 0))
        self.idle[site] = self.idle.get(site, 0) - n
        self.closing[site] = self.closing.get(site, 0) + n

    def quit_done(self, site: str) -> None:
        self.closing[site] = 0


async def _slots_of(store: MemoryDestinations, owner: str) -> int:
    held = 0
    for key in await store.keys("slot."):
        value = (await store.get(key)).value
        held += value is not None and value.get("owner") == owner
    return held


async def test_holder_gives_slots_over_its_fair_share_to_a_worker_that_wants_the_site() -> None:
    """Two workers, 4 sessions: a holds all 4; b finds none and makes its demand known; a
    keeps its 4 sessions busy, and gives up a slot as each delivery ends until it holds
    its fair share (2), where before it kept them until its next renewal (slot_ttl_s / 3)
    and b put its mail back for seconds."""
    store, clock = MemoryDestinations(), _Clock()
    a, b = _dest(store, clock, sessions=4), _dest(store, clock, sessions=4)
    held = [await a.admit("x.test") for _ in range(4)]
    assert all(h.go for h in held)
    refused = await b.admit("x.test")
    assert not refused.go and refused.reason == "full"
    assert [o for o, _ in a._sites["x.test"].state.demand] == []  # a has not read it yet
    await asyncio.sleep(0.01)  # a reads the site's state at most every state_refresh_s
    await a.rebalance()
    assert await _slots_of(store, a.owner) == 4  # all four in use: nothing given up yet
    await a.done(held[0], OK)
    assert await _slots_of(store, a.owner) == 3
    await a.done(held[1], OK)
    await a.done(held[2], OK)  # its share is 2: one delivery under way keeps one of them
    assert await _slots_of(store, a.owner) == 2
    b._sites["x.test"].full_until = 0  # (b would look again after FULL_MEMO_S)
    assert [(await b.admit("x.test")).go for _ in range(3)] == [True, True, False]


async def test_waiting_worker_takes_a_slot_given_up_while_its_mail_waits() -> None:
    """b's delivery waits (slot_wait_s) instead of being put back: it looks for a free
    slot every FULL_MEMO_S and takes the one a gives up when a delivery of a ends."""
    store, clock = MemoryDestinations(), _Clock()
    a = _dest(store, clock, sessions=2, slot_wait_s=5)
    b = _dest(store, clock, sessions=2, slot_wait_s=5)
    held = [await a.admit("x.test") for _ in range(2)]
    waiting = asyncio.create_task(b.admit("x.test"))
    for _ in range(100):  # b's demand is written before it waits
        await asyncio.sleep(0.01)
        if (await store.get(site_key("x.test"))).value is not None:
            break
    await asyncio.sleep(0.01)  # (state_refresh_s)
    await a.rebalance()
    await a.done(held[0], OK)
    got = await asyncio.wait_for(waiting, 5 * FULL_MEMO_S)
    assert got.go and await _slots_of(store, b.owner) == 1
    assert await _slots_of(store, a.owner) == 1


async def test_idle_sessions_over_the_fair_share_are_closed_before_their_slots_go() -> None:
    """The connection cache of a keeps 4 idle sessions of the site, each holding a slot.
    Once b wants the site, a closes the 2 over its share, and gives their 2 slots up only
    once their QUIT completed: never more sessions open than slots held."""
    store, clock, sessions = MemoryDestinations(), _Clock(), _Sessions()
    a, b = _dest(store, clock, sessions=4), _dest(store, clock, sessions=4)
    a.idle_sessions, a.shed_sessions = sessions.count, sessions.shed
    for adm in [await a.admit("x.test") for _ in range(4)]:
        await a.done(adm, OK)
        sessions.idle["x.test"] = sessions.idle.get("x.test", 0) + 1  # kept idle
    assert not (await b.admit("x.test")).go
    await asyncio.sleep(0.01)  # (state_refresh_s)
    await a.rebalance()
    assert sessions.count("x.test") == (2, 2)  # two closing
    assert await _slots_of(store, a.owner) == 4  # their slots are kept while they close
    await a.rebalance()
    assert sessions.count("x.test") == (2, 2)  # those closing count as gone: none more
    sessions.quit_done("x.test")
    await a.rebalance()
    assert await _slots_of(store, a.owner) == 2


async def test_a_delivery_waiting_for_a_unit_goes_when_an_idle_session_is_reused() -> None:
    """Two slots, two idle sessions kept by the connection cache: the first delivery is to
    reuse one; until it takes it, a second counts both idle sessions as in use and waits.
    The take (``session_reused``) lets it go at once, not after the next delivery ends."""
    store, clock, sessions = MemoryDestinations(), _Clock(), _Sessions()
    a = _dest(store, clock, sessions=2, slot_wait_s=10)
    a.idle_sessions = sessions.count
    for adm in [await a.admit("x.test") for _ in range(2)]:
        await a.done(adm, OK)
    sessions.idle["x.test"] = 2
    first = await a.admit("x.test")
    assert first.go
    second = asyncio.create_task(a.admit("x.test"))
    await asyncio.sleep(0.05)
    assert not second.done()  # 1 delivery + 2 idle sessions = both slots
    sessions.idle["x.test"] = 1  # the first delivery takes its idle session
    a.session_reused("x.test")
    assert (await asyncio.wait_for(second, 1.0)).go


async def test_a_new_session_waits_until_the_idle_one_it_was_admitted_on_is_closed() -> None:
    """One slot, one idle session: a delivery is admitted to reuse it. When it cannot
    (another MX host of the site) and must open a session of its own, ``connecting``
    closes the idle one and returns only once its QUIT ended (``session_closed``): two
    sessions of the site are never open at once. With room, it returns at once."""
    store, clock, sessions = MemoryDestinations(), _Clock(), _Sessions()
    a = _dest(store, clock, sessions=1, slot_wait_s=10)
    a.idle_sessions, a.shed_sessions = sessions.count, sessions.shed
    await a.done(await a.admit("x.test"), OK)
    sessions.idle["x.test"] = 1  # its session kept idle by the connection cache
    adm = await a.admit("x.test")
    assert adm.go  # counting on the idle session
    opening = asyncio.create_task(a.connecting("x.test"))
    await asyncio.sleep(0.05)
    assert not opening.done() and sessions.count("x.test") == (0, 1)  # its QUIT under way
    sessions.quit_done("x.test")
    a.session_closed("x.test")
    await asyncio.wait_for(opening, 1.0)
    await a.done(adm, OK)
    adm = await a.admit("x.test")  # no idle session: the slot is this delivery's own
    await asyncio.wait_for(a.connecting("x.test"), 0.1)
    assert sessions.count("x.test") == (0, 0)


async def test_deliveries_admitted_before_a_throttle_open_their_sessions_at_once() -> None:
    """Four sessions, four deliveries admitted; one gets 421 and the site's sessions are
    halved. The three still under way open their sessions without waiting for room (the
    measure is the slots held): held back for seconds, those to a site going down
    connected inside its cool-off, as extra probes."""
    store, clock = MemoryDestinations(), _Clock()
    a = _dest(store, clock, sessions=4)
    admitted = [await a.admit("x.test") for _ in range(4)]
    throttled = Attempt(
        {"a@x.test": Reply(code=421, enhanced="4.7.0", text="too many", remote_host="mx")},
        "mx",
    )
    await a.done(admitted[0], throttled)
    assert not (await a.admit("x.test")).go  # the lower limit holds new admissions back
    for _ in admitted[1:]:
        await asyncio.wait_for(a.connecting("x.test"), 0.2)


class _FailingPuts(MemoryDestinations):
    """The memory bucket, its writes refused while ``failing`` (a NATS outage)."""

    failing = False

    async def put(
        self, key: str, value: dict[str, object], *, revision: int | None, ttl_s: float
    ) -> int | None:
        if self.failing:
            raise StoreUnavailable("destinations bucket: no responders")
        return await super().put(key, value, revision=revision, ttl_s=ttl_s)


async def test_a_new_session_opens_when_the_bucket_fails_while_it_makes_room() -> None:
    """The wait for room needs another slot and the bucket refuses the write: the session
    opens (the limits are best effort through an outage, as admission is); the delivery
    is not failed by a StoreUnavailable from the middle of its SMTP attempt."""
    store, clock, sessions = _FailingPuts(), _Clock(), _Sessions()
    a = _dest(store, clock, sessions=2, slot_wait_s=10)
    a.idle_sessions, a.shed_sessions = sessions.count, sessions.shed
    await a.done(await a.admit("x.test"), OK)
    sessions.idle["x.test"] = 1
    adm = await a.admit("x.test")  # counting on the idle session
    assert adm.go
    store.failing = True
    await asyncio.wait_for(a.connecting("x.test"), 1.0)  # 1 held, 2 needed: no slot, no error


async def test_a_quit_ending_over_the_fair_share_wakes_no_waiter_of_the_holder() -> None:
    """a holds both slots, one delivery under way and one session idle; b wants the site,
    so a (share 1) closes the idle session to give its slot up. A delivery of a that
    comes meanwhile waits. When the QUIT ends it is not woken (it would take the slot back
    and b would wait on): the slot goes to b at a's next rebalance."""
    store, clock, sessions = MemoryDestinations(), _Clock(), _Sessions()
    a = _dest(store, clock, sessions=2, slot_wait_s=10)
    b = _dest(store, clock, sessions=2)
    a.idle_sessions, a.shed_sessions = sessions.count, sessions.shed
    first, second = await a.admit("x.test"), await a.admit("x.test")
    sessions.idle["x.test"] = 1  # the second delivery's session is kept idle
    await a.done(second, OK)
    assert not (await b.admit("x.test")).go  # b's demand is written
    await asyncio.sleep(0.01)  # (state_refresh_s)
    await a.rebalance()
    assert sessions.count("x.test") == (0, 1)  # closed for b
    waiting = asyncio.create_task(a.admit("x.test"))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # one delivery and one closing session: both slots
    sessions.quit_done("x.test")
    a.session_closed("x.test")
    await asyncio.sleep(0.05)
    assert not waiting.done(), "a waiter of a took the slot a closed the session to give up"
    await a.rebalance()
    assert await _slots_of(store, a.owner) == 1
    b._sites["x.test"].full_until = 0  # (b would look again after FULL_MEMO_S)
    assert (await b.admit("x.test")).go
    await a.done(first, OK)
    assert (await asyncio.wait_for(waiting, 1.0)).go


async def test_a_contended_scan_reads_the_slots_in_one_request_and_takes_a_free_one() -> None:
    """Slots 0..5 of a site, all but one held by another worker, the free one a delete
    marker: the scan tries one number, then reads the slots in one batched request and
    takes the free one by compare-and-set on the marker (it used to try each number with
    a create and a read: two requests per number taken)."""
    store, clock = MemoryDestinations(), _Clock()
    a, b = _dest(store, clock, sessions=6), _dest(store, clock, sessions=6)
    held = [await a.admit("x.test") for _ in range(6)]
    assert all(h.go for h in held)
    gone = min(a._sites["x.test"].slots)
    assert await store.delete(slot_key("x.test", gone), revision=a._sites["x.test"].slots.pop(gone))
    calls: list[str] = []
    for name in ("get", "get_many", "put"):
        real = getattr(store, name)

        async def counted(*args: object, _real: Any = real, _name: str = name, **kw: object) -> Any:
            calls.append(_name)
            return await _real(*args, **kw)

        setattr(store, name, counted)
    got = await b.admit("x.test")
    assert got.go and list(b._sites["x.test"].slots) == [gone]
    assert calls.count("get_many") <= 1 and "get" not in calls[1:]
    assert calls.count("put") <= 2  # the random first try, then the free one


async def test_full_tells_what_early_would_refuse_and_changes_nothing() -> None:
    """The worker skips the entry read of an item whose site is known full
    (``Destinations.full``); asking must not count a put-back nor move the pacing, and it
    answers as ``early`` then does."""
    store, clock = MemoryDestinations(), _Clock()
    a, b = _dest(store, clock, sessions=1), _dest(store, clock, sessions=1)
    assert not b.full("x.test")  # never seen: admit decides
    assert (await a.admit("x.test")).go
    assert not (await b.admit("x.test")).go  # b's scan found the site full
    site = b._sites["x.test"]
    site.waiters = 1  # as many waiting as it keeps: further items go back at once
    counted, paced = dict(site.deferred), site.paced_until
    assert b.full("x.test") and b.full("x.test")
    assert (site.deferred, site.paced_until) == (counted, paced)
    refused = b.early("x.test")
    assert refused is not None and refused.reason == "full"
    assert site.deferred["full"] == counted["full"] + 1 and site.paced_until > paced
    site.waiters = 0
    assert not b.full("x.test") and b.early("x.test") is None  # one more may wait


async def test_items_of_a_full_site_are_put_back_paced_not_all_for_the_same_delay() -> None:
    """Refusals in a row come back one turnover step apart (the site's units turning over
    every HOLD_GUESS_S until measured), never after more than full_delay_s."""
    store, clock = MemoryDestinations(), _Clock()
    a, b = _dest(store, clock, sessions=2), _dest(store, clock, sessions=2, full_delay_s=1)
    assert all([(await a.admit("x.test")).go for _ in range(2)])
    delays = [(await b.admit("x.test")).delay_s for _ in range(40)]
    assert delays[0] < delays[3] < delays[6] < delays[9]  # paced one after another
    assert max(delays) <= 1.1  # the longest, jittered by at most a tenth


def test_metrics_name_the_top_sites_and_sum_the_rest() -> None:
    """``jsqueue_destination_sessions{site}`` and friends with a bounded label set."""
    from prometheus_client import CollectorRegistry, generate_latest

    from jsqueue.destination_metrics import DestinationCollector
    from jsqueue.limits import SiteSnapshot

    snaps = [
        SiteSnapshot("a.test", 5, 5, 20, 20, SiteStatus.UP, {"full": 7}),
        SiteSnapshot("b.test", 2, 1, 20, 10, SiteStatus.UP, {}),
        SiteSnapshot("c.test", 0, 0, 20, 1, SiteStatus.DOWN, {"down": 30}),
        SiteSnapshot("d.test", 1, 1, 20, 20, SiteStatus.UP, {"down": 2}),
    ]
    registry = CollectorRegistry()
    registry.register(DestinationCollector(lambda: snaps, top=2))
    text = generate_latest(registry).decode()
    assert 'jsqueue_destination_sessions{site="a.test"} 5.0' in text
    assert 'jsqueue_destination_sessions{site="b.test"} 2.0' in text
    assert 'jsqueue_destination_sessions{site="other"} 1.0' in text
    assert 'jsqueue_destination_down{site="other"} 1.0' in text
    assert 'jsqueue_destination_deferrals_total{reason="down",site="other"} 32.0' in text
    assert 'jsqueue_destination_allowed_sessions{site="b.test"} 10.0' in text
    assert "c.test" not in text and "d.test" not in text


async def test_destination_store_contract(stores: Stores) -> None:
    """Both backends of the destinations bucket: create-if-absent, compare-and-set, delete
    marker then create on it, TTL expiry, listing by prefix (real nats-server for
    JetStream)."""
    d = stores.destinations
    assert d is not None
    assert await d.get("slot.x.0") == Keyed(None, 0)
    rev = await d.put("slot.x.0", {"owner": "a"}, revision=0, ttl_s=60)
    assert rev is not None
    assert await d.put("slot.x.0", {"owner": "b"}, revision=0, ttl_s=60) is None  # taken
    assert (await d.get("slot.x.0")).value == {"owner": "a"}
    renewed = await d.put("slot.x.0", {"owner": "a"}, revision=rev, ttl_s=60)
    assert renewed is not None and renewed != rev
    assert await d.put("slot.x.0", {"owner": "c"}, revision=rev, ttl_s=60) is None  # stale
    assert not await d.delete("slot.x.0", revision=rev)
    assert await d.delete("slot.x.0", revision=renewed)
    marker = await d.get("slot.x.0")
    assert marker.value is None
    again = await d.put("slot.x.0", {"owner": "b"}, revision=marker.revision, ttl_s=60)
    assert again is not None
    assert await d.put("slot.y.0", {"owner": "z"}, revision=None, ttl_s=1) is not None
    assert await d.keys("slot.") == ["slot.x.0", "slot.y.0"]
    assert await d.delete("slot.x.0", revision=again)
    marker = await d.get("slot.x.0")
    many = await d.get_many(["slot.x.0", "slot.y.0", "slot.never.0"])
    assert many == {  # one batched read, as get reads each key
        "slot.x.0": marker,
        "slot.y.0": await d.get("slot.y.0"),
        "slot.never.0": Keyed(None, 0),
    }
    assert await d.get_many([]) == {}
    assert await d.put("slot.x.0", {"owner": "b"}, revision=marker.revision, ttl_s=60)

    async def expired() -> bool:
        return (await d.get("slot.y.0")).value is None

    deadline = asyncio.get_running_loop().time() + 5
    while not await expired():
        assert asyncio.get_running_loop().time() < deadline, "TTL not honoured"
        await asyncio.sleep(0.1)
    assert await d.keys("slot.") == ["slot.x.0"]
