"""Pure state transitions (jsqueue.state): checks, claims, outcomes, expiry, and the
operators' flush, hold, release and bounce."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from jsqueue import replies
from jsqueue.envelope import Entry, Lease, Recipient, RecipientState, WorkItem, utcnow
from jsqueue.names import new_queue_id
from jsqueue.operator_state import bounced, flushed, held, released_from_hold, requeued
from jsqueue.replies import Reply
from jsqueue.retry import RetryPolicy
from jsqueue.state import (
    CREATE_GRACE_S,
    CREATE_RETRY_S,
    Verdict,
    check,
    claim,
    expire_all,
    hold,
    holds,
    record,
    recorded_at,
    release,
    renewed,
    settled,
    site_deferred,
    taken_over,
)

T0 = datetime(2026, 3, 2, 9, 0, 5, tzinfo=UTC)
POLICY = RetryPolicy(base_s=60, factor=2, max_delay_s=3600, max_age_s=86400, jitter=0)


def make_entry(*addresses: str, reverse_path: str = "alice@example.test") -> Entry:
    return Entry(
        id=new_queue_id(),
        reverse_path=reverse_path,
        recipients=[Recipient.from_address(a) for a in addresses],
        created_at=T0,
        size=100,
    )


def reply(code: int, enhanced: str, text: str = "x") -> Reply:
    return Reply(code=code, enhanced=enhanced, text=text, remote_host="mx.mixed.example.test")


def test_check_verdicts_follow_kv_truth() -> None:
    """DESIGN.md §2.2: gone, stale, held, nothing open → drop; early → later; else deliver."""
    e = make_entry("a@mixed.example.test")
    item = WorkItem(e.id, "mixed.example.test", 0)
    old = WorkItem(new_queue_id(int((T0 - timedelta(minutes=5)).timestamp() * 1000)), "x.test")
    assert check(None, old, T0).verdict is Verdict.DROP
    assert check(e, WorkItem(e.id, "mixed.example.test", 1), T0).verdict is Verdict.DROP
    assert check(e.model_copy(update={"held": True}), item, T0).verdict is Verdict.DROP
    assert check(e, WorkItem(e.id, "other.example.test", 0), T0).verdict is Verdict.DROP
    assert check(e, item, T0).verdict is Verdict.DELIVER
    later = e.model_copy(deep=True)
    later.recipients[0].next_attempt_at = T0 + timedelta(seconds=300)
    c = check(later, item, T0)
    assert c.verdict is Verdict.LATER
    assert 299 <= c.delay_s <= 300


def test_lease_of_another_worker_defers_until_it_ends() -> None:
    """DESIGN.md §2.3: a running lease keeps a second worker out; an expired one does not."""
    e = make_entry("a@mixed.example.test")
    item = WorkItem(e.id, "mixed.example.test", 0)
    claimed = claim(e, "mixed.example.test", "w1", T0, lease_s=30)
    assert claimed.recipients[0].state is RecipientState.ACTIVE
    c = check(claimed, item, T0 + timedelta(seconds=10))
    assert c.verdict is Verdict.LATER and 19 <= c.delay_s <= 20
    assert check(claimed, item, T0 + timedelta(seconds=31)).verdict is Verdict.DELIVER
    released = release(claimed, "mixed.example.test")
    assert released.recipients[0].state is RecipientState.PENDING
    assert "mixed.example.test" not in released.leases


def test_own_lease_is_renewed_from_half_time() -> None:
    """DESIGN.md §2.3: the holder renews its lease once half of it has run, so it never
    runs out under a live worker; a lease of another owner, or none, is left alone."""
    domain = "mixed.example.test"
    claimed = claim(make_entry(f"a@{domain}"), domain, "w1", T0, lease_s=30)
    assert renewed(claimed, domain, "w1", T0 + timedelta(seconds=14), 30) is None
    later = T0 + timedelta(seconds=15)
    new = renewed(claimed, domain, "w1", later, 30)
    assert new is not None and new.leases[domain] == Lease(
        owner="w1", until=later + timedelta(seconds=30)
    )
    assert claimed.leases[domain].until == T0 + timedelta(seconds=30)  # the input is untouched
    assert new.recipients == claimed.recipients
    late = T0 + timedelta(seconds=45)  # run out, but nobody took it: still ours to renew
    assert renewed(claimed, domain, "w1", late, 30) is not None
    assert renewed(claimed, domain, "w2", later, 30) is None
    assert renewed(release(claimed, domain), domain, "w1", later, 30) is None


def test_a_lease_is_told_by_its_process_not_only_its_name() -> None:
    """DESIGN.md §2.3: a lease records its process (instance). The same name with another
    instance is a later process that took the destination over (this one hung past its
    presence grace): not this process's to renew, record over or give back. A lease
    written without an instance, or a caller that names none, goes by the name alone."""
    domain = "mixed.example.test"
    mine = claim(make_entry(f"a@{domain}"), domain, "w1", T0, 30, instance="p1")
    assert mine.leases[domain].instance == "p1"
    assert holds(mine, domain, "w1", "p1") and holds(mine, domain, "w1")
    assert not holds(mine, domain, "w1", "p2") and not holds(mine, domain, "w2", "p1")
    assert taken_over(mine, domain, "w1", "p1") is None
    assert taken_over(mine, domain, "w1", "p2") == mine.leases[domain]
    assert taken_over(mine, domain, "w2", "p1") == mine.leases[domain]
    assert taken_over(release(mine, domain), domain, "w1", "p1") is None  # none: free
    legacy = claim(make_entry(f"a@{domain}"), domain, "w1", T0, 30)
    assert holds(legacy, domain, "w1", "p2") and taken_over(legacy, domain, "w1", "p2") is None
    later = T0 + timedelta(seconds=20)
    again = renewed(mine, domain, "w1", later, 30, instance="p1")
    assert again is not None and again.leases[domain].instance == "p1"  # the instance kept
    assert renewed(mine, domain, "w1", later, 30, instance="p2") is None
    kept = hold(mine, domain, "w1", "too large", instance="p2")
    assert kept.leases == mine.leases and kept.held  # not given back: another process's


def test_an_attempt_is_found_recorded_by_its_instant() -> None:
    """An attempt recorded with its end instant is found in the entry by that instant (to
    the microsecond), on its own domain only: the worker does not apply a record twice
    whose first write's reply was lost (jsqueue.recording)."""
    at = T0 + timedelta(seconds=3, microseconds=417)
    e = claim(
        make_entry("a@one.example.test", "b@two.example.test"), "one.example.test", "w", T0, 60
    )
    assert not recorded_at(e, "one.example.test", at)
    new, _ = record(
        e,
        "one.example.test",
        {"a@one.example.test": reply(450, "4.2.0")},
        at,
        POLICY,
        random.Random(1),
    )
    assert recorded_at(new, "one.example.test", at)
    assert not recorded_at(new, "one.example.test", at + timedelta(microseconds=1))
    assert not recorded_at(new, "two.example.test", at)
    assert recorded_at(Entry.model_validate_json(new.model_dump_json()), "one.example.test", at)


def test_mixed_replies_give_per_recipient_states() -> None:
    """CASE-07: 250 / 450 / 550 in one transaction → delivered / deferred / bounced."""
    e = make_entry("a@mixed.example.test", "b@mixed.example.test", "c@mixed.example.test")
    e = claim(e, "mixed.example.test", "w1", T0, 600)
    outcomes = {
        "a@mixed.example.test": reply(250, "2.0.0"),
        "b@mixed.example.test": reply(450, "4.2.1"),
        "c@mixed.example.test": reply(550, "5.1.1"),
    }
    new, rec = record(e, "mixed.example.test", outcomes, T0, POLICY, random.Random(1))
    states = [r.state for r in new.recipients]
    assert states == [RecipientState.DELIVERED, RecipientState.DEFERRED, RecipientState.BOUNCED]
    assert [r.attempts for r in new.recipients] == [1, 1, 1]
    assert new.recipients[1].next_attempt_at == T0 + timedelta(seconds=60)
    assert rec.retry_delay_s == 60
    assert settled(new) and not new.is_final
    assert new.leases == {}
    # attempt 2 offers only b@ (delivered recipients are never offered again)
    assert [r.address for r in new.open_recipients("mixed.example.test")] == [
        "b@mixed.example.test"
    ]
    done, rec2 = record(
        new,
        "mixed.example.test",
        {"b@mixed.example.test": reply(250, "2.0.0")},
        T0 + timedelta(seconds=60),
        POLICY,
        random.Random(1),
    )
    assert done.is_final and rec2.retry_delay_s is None
    assert done.recipients[1].attempts == 2


def test_record_marks_recipients_a_dsn_capable_next_hop_took() -> None:
    """RFC 3461 §5.2.1, §6.2.1: a recipient accepted by a next hop that advertised DSN (its
    NOTIFY/ORCPT passed on) is recorded ``next_hop_dsn``; one accepted elsewhere or not
    accepted is not."""
    e = make_entry("a@mixed.example.test", "b@mixed.example.test", "c@mixed.example.test")
    e = claim(e, "mixed.example.test", "w1", T0, 600)
    outcomes = {
        "a@mixed.example.test": reply(250, "2.0.0"),
        "b@mixed.example.test": reply(250, "2.0.0"),
        "c@mixed.example.test": reply(450, "4.2.1"),
    }
    took = frozenset({"a@mixed.example.test", "c@mixed.example.test"})
    new, _ = record(
        e, "mixed.example.test", outcomes, T0, POLICY, random.Random(1), next_hop_dsn=took
    )
    assert [r.next_hop_dsn for r in new.recipients] == [True, False, False]


def test_missing_reply_counts_as_temporary() -> None:
    """A recipient the attempt gave no reply for is retried, never dropped."""
    e = make_entry("a@mixed.example.test")
    new, rec = record(e, "mixed.example.test", {}, T0, POLICY, random.Random(1))
    assert new.recipients[0].state is RecipientState.DEFERRED
    assert new.recipients[0].last_reply == replies.R451_PROTOCOL_ERROR
    assert rec.deferred


def test_expiry_bounces_with_last_reply_and_null_path_fails() -> None:
    """RFC 5321 §4.5.4.1: past the lifetime a deferred recipient is bounced (4.4.7 DSN);
    mail from <> is marked failed instead (RFC 5321 §4.5.5, no DSN owed)."""
    e = make_entry("a@mixed.example.test")
    late = T0 + timedelta(days=2)
    new, rec = record(
        e,
        "mixed.example.test",
        {"a@mixed.example.test": reply(451, "4.3.0")},
        late,
        POLICY,
        random.Random(1),
    )
    assert new.recipients[0].state is RecipientState.BOUNCED
    assert new.recipients[0].last_reply is not None
    assert new.recipients[0].last_reply.code == 451
    assert rec.expired and rec.retry_delay_s is None
    null = make_entry("a@mixed.example.test", reverse_path="")
    expired = expire_all(null, "mixed.example.test", late, POLICY)
    assert expired is not None
    assert expired.recipients[0].state is RecipientState.FAILED
    assert expire_all(null, "mixed.example.test", T0, POLICY) is None


def test_the_final_try_at_the_deadline_is_made_before_anything_expires() -> None:
    """RFC 5321 §4.5.4.1, :mod:`jsqueue.retry`: after a failure the last attempt is
    scheduled *at* the deadline and the failure of that try expires the recipient. Its work
    item comes back at (or a moment after) the deadline: the claim must not expire it
    first, or the final try is never made and mail the next hop would take now bounces."""
    e = make_entry("a@mixed.example.test", "b@mixed.example.test")
    deadline = POLICY.deadline(T0)
    tried, _ = record(
        e,
        "mixed.example.test",
        {a: reply(451, "4.7.1") for a in ("a@mixed.example.test", "b@mixed.example.test")},
        deadline - timedelta(seconds=30),
        POLICY,
        random.Random(1),
    )
    assert [r.next_attempt_at for r in tried.recipients] == [deadline, deadline]
    for late in (deadline, deadline + timedelta(milliseconds=300), deadline + timedelta(days=1)):
        assert expire_all(tried, "mixed.example.test", late, POLICY) is None
    # That try: a failure expires its recipient (no further retry), a 250 delivers.
    _, rec = record(
        tried,
        "mixed.example.test",
        {"a@mixed.example.test": reply(451, "4.7.1"), "b@mixed.example.test": reply(250, "2.0.0")},
        deadline + timedelta(milliseconds=300),
        POLICY,
        random.Random(1),
    )
    assert [r.address for r in rec.expired] == ["a@mixed.example.test"]
    assert [r.address for r in rec.delivered] == ["b@mixed.example.test"]
    # Never tried, or put off past the deadline without a try: expired at the claim.
    assert expire_all(e, "mixed.example.test", deadline, POLICY) is not None
    put_off = tried.model_copy(deep=True)
    for r in put_off.recipients:
        r.next_attempt_at = deadline + timedelta(minutes=5)
    assert expire_all(put_off, "mixed.example.test", deadline + timedelta(minutes=5), POLICY)


def test_a_lifetime_that_runs_out_ends_every_destination_for_one_dsn() -> None:
    """RFC 3464 §2 (one report per message and event), RFC 5321 §4.5.4.1: once the
    lifetime has run out, the expiry at one domain's claim also expires the open
    recipients of the other domains that are owed no final try and that no attempt holds;
    one owed its final try is left for that try, and :func:`settled` waits for it (past
    the deadline, not before), so that every expired recipient is in one DSN."""
    one, two, three, four = (f"{u}@{u}.example.test" for u in ("one", "two", "three", "four"))
    e = make_entry(one, two, three, four)
    deadline = POLICY.deadline(T0)
    for r in e.recipients:
        r.state, r.attempts = RecipientState.DEFERRED, 1
        r.next_attempt_at = deadline + timedelta(hours=1)  # put off past the deadline
    e.recipients[2].next_attempt_at = deadline  # three: owed its final try
    e.leases["four.example.test"] = Lease(owner="w", until=deadline + timedelta(minutes=5))
    late = deadline + timedelta(hours=1)
    new = expire_all(e, "one.example.test", late, POLICY)
    assert new is not None
    assert [r.state.value for r in new.recipients] == ["bounced", "bounced", "deferred", "deferred"]
    assert new.recipients[1].last_reply == replies.R451_EXPIRED
    new.leases.pop("four.example.test")
    new.recipients[3].state = RecipientState.BOUNCED
    early = deadline - timedelta(seconds=POLICY.min_delay_s + 1)
    assert settled(new) and settled(new, early, POLICY)
    assert not settled(new, late, POLICY), "three's final try is still owed"
    new.recipients[2].state = RecipientState.BOUNCED
    assert settled(new, late, POLICY)


def test_a_final_try_failed_just_before_the_deadline_waits_for_the_others() -> None:
    """RFC 3464 §2, jsqueue.retry: a try failing less than ``min_delay_s`` before the
    deadline expires its recipient at once; the other domain's final try, due at the
    deadline, is still owed, so the entry is not settled and the expiry DSN waits to list
    both. It used to go out at once for the first domain alone, a second DSN after it."""
    one, two = "a@one.example.test", "b@two.example.test"
    e = make_entry(one, two)
    deadline = POLICY.deadline(e.created_at)
    for r in e.recipients:
        r.state, r.attempts, r.next_attempt_at = RecipientState.DEFERRED, 9, deadline
    now = deadline - timedelta(seconds=POLICY.min_delay_s / 2)
    assert now >= POLICY.expiring_from(e.created_at)
    fail = Reply(code=451, enhanced="4.3.0", text="later", remote_host="mx.one.example.test")
    new, done = record(e, "one.example.test", {one: fail}, now, POLICY, random.Random(0))
    assert done.expired and [r.state.value for r in new.recipients] == ["bounced", "deferred"]
    assert not settled(new, now, POLICY), "two's final try is still owed"
    new.recipients[1].state = RecipientState.BOUNCED
    assert settled(new, now, POLICY)


def test_settled_waits_for_every_destination() -> None:
    """One DSN per message and event (RFC 3464 §2): not while another domain is pending."""
    e = make_entry("a@one.example.test", "b@two.example.test")
    new, _ = record(
        e,
        "one.example.test",
        {"a@one.example.test": reply(550, "5.1.1")},
        T0,
        POLICY,
        random.Random(1),
    )
    assert not settled(new)
    new.leases["two.example.test"] = Lease(owner="w", until=T0)
    new, _ = record(
        new,
        "two.example.test",
        {"b@two.example.test": reply(550, "5.1.1")},
        T0,
        POLICY,
        random.Random(1),
    )
    assert settled(new) and new.is_final


def test_transitions_never_change_their_input() -> None:
    """Pure functions (STYLE.md): claim, record, release and expire_all return a new entry
    and leave the one they were given as it was, leases and recipients included (the
    worker retries a failed compare-and-set from the entry it read)."""
    e = make_entry("a@x.test", "b@x.test", "c@y.test")
    e.leases["y.test"] = Lease(owner="w0", until=T0)
    before = e.to_json()
    claimed = claim(e, "x.test", "w1", T0, 60)
    assert e.to_json() == before
    assert claimed.leases["x.test"].owner == "w1" and "x.test" not in e.leases
    outcomes = {"a@x.test": reply(250, "2.0.0"), "b@x.test": reply(450, "4.2.0")}
    snapshot = claimed.to_json()
    recorded, _ = record(claimed, "x.test", outcomes, T0, POLICY, random.Random(1))
    assert claimed.to_json() == snapshot
    assert [r.state for r in claimed.recipients][:2] == [RecipientState.ACTIVE] * 2
    assert recorded.recipients[0].state is RecipientState.DELIVERED
    release(claimed, "x.test")
    assert claimed.to_json() == snapshot
    expire_all(claimed, "x.test", T0 + timedelta(days=30), POLICY)
    assert claimed.to_json() == snapshot


def test_item_ahead_of_its_entry_is_tried_again_within_the_grace() -> None:
    """The front end stores the entry and publishes the work items at the same time: an item
    whose entry is missing is retried shortly while its queue id is younger than
    CREATE_GRACE_S (also when the id's clock is ahead of ours), then dropped."""
    created = T0 - timedelta(seconds=1)
    item = WorkItem(new_queue_id(int(created.timestamp() * 1000)), "x.test")
    for now in (T0 - timedelta(seconds=5), T0, created + timedelta(seconds=CREATE_GRACE_S - 1)):
        c = check(None, item, now)
        assert (c.verdict, c.delay_s) == (Verdict.LATER, CREATE_RETRY_S), now
    assert check(None, item, created + timedelta(seconds=CREATE_GRACE_S + 1)).verdict is (
        Verdict.DROP
    )


# --------------------------------------------------------------------------- operators


def deferred_entry() -> Entry:
    """An entry ten minutes old with one deferred recipient at a.example.test."""
    created = utcnow() - timedelta(minutes=10)
    return Entry(
        id=new_queue_id(int(created.timestamp() * 1000)),
        reverse_path="alice@example.test",
        recipients=[
            Recipient(
                address="u@a.example.test", domain="a.example.test", state=RecipientState.DEFERRED
            )
        ],
        created_at=created,
        size=1000,
    )


def test_operator_changes() -> None:
    """The pure transitions: flush makes open recipients of one domain due and bumps the
    generation; hold/release toggle; bounce skips a domain under a running lease and uses
    ``failed`` for the null reverse-path (no DSN owed, RFC 5321 §4.5.5)."""
    now = utcnow()
    e = deferred_entry()
    e.recipients.append(Recipient(address="v@b.example.test", domain="b.example.test"))
    e.recipients[0].next_attempt_at = now + timedelta(hours=1)
    new, _ = flushed(e, now, "a.example.test")
    assert new is not None and new.generation == 1
    assert new.recipients[0].next_attempt_at == now
    assert new.recipients[1].next_attempt_at is None
    assert flushed(e, now, "c.example.test")[0] is None
    h, _ = held(e)
    assert h is not None and h.held and held(h)[0] is None
    assert flushed(h, now)[0] is None  # held: release instead
    r, _ = released_from_hold(h, now)
    assert r is not None and not r.held and r.generation == 1
    assert released_from_hold(e, now)[0] is None
    e.leases["b.example.test"] = Lease(owner="w", until=now + timedelta(minutes=5))
    reply = Reply(code=550, enhanced="5.7.1", text="x")
    b, detail = bounced(e, now, reply)
    assert b is not None and "b.example.test" in detail
    assert [x.state for x in b.recipients] == [RecipientState.BOUNCED, RecipientState.PENDING]
    live, detail = flushed(e, now, "b.example.test")
    assert live is None and "leased by w until" in detail  # a running lease is never broken
    both, detail = flushed(e, now)
    assert both is not None and both.leases == e.leases and "leased by w" in detail
    assert [x.next_attempt_at for x in both.recipients] == [now, None]
    ran_out = e.model_copy(deep=True)
    ran_out.leases["b.example.test"] = Lease(owner="w", until=now)
    ran_out.recipients[1].state = RecipientState.ACTIVE
    freed, detail = flushed(ran_out, now, "b.example.test")
    assert freed is not None and freed.leases == {} and "expired" in detail
    assert freed.recipients[1].state is RecipientState.PENDING
    assert freed.recipients[1].next_attempt_at == now
    null = e.model_copy(update={"reverse_path": "", "leases": {}})
    b2, _ = bounced(null, now, reply)
    assert b2 is not None
    assert [x.state for x in b2.recipients] == [RecipientState.FAILED, RecipientState.FAILED]
    assert all(x.last_reply == reply for x in b2.recipients)


def test_recorded_replies_are_bounded_utf8_safe() -> None:
    """A long multi-line reply (RFC 5321 §4.2.1) is kept cut to
    :data:`~jsqueue.replies.STORED_REPLY_OCTETS` octets with the marker, never inside a
    UTF-8 sequence; codes and remote host stay; a short reply is kept as it is."""
    long_text = "\n".join("Grüße ü€ " * 30 for _ in range(10))
    e = make_entry("a@mixed.example.test", "b@mixed.example.test")
    outcomes = {
        "a@mixed.example.test": reply(250, "2.0.0", long_text),
        "b@mixed.example.test": reply(450, "4.2.1", "short"),
    }
    new, _ = record(e, "mixed.example.test", outcomes, T0, POLICY, random.Random(1))
    a, b = (r.last_reply for r in new.recipients)
    assert a is not None and b is not None
    assert len(a.text.encode()) <= replies.STORED_REPLY_OCTETS
    assert a.text.endswith(replies.CUT_MARKER) and long_text.startswith(a.text[:-6])
    assert (a.code, a.enhanced, a.remote_host) == (250, "2.0.0", "mx.mixed.example.test")
    assert b == outcomes["b@mixed.example.test"]
    assert a.bounded() == a
    for octets in range(0, 40):
        cut = Reply(code=250, text="€" * 20).bounded(octets)
        assert cut.text == "[...]" or cut.text == "€" * cut.text.count("€") + replies.CUT_MARKER
        assert len(cut.text.encode()) <= max(octets, 5)


def test_hold_gives_back_only_the_owners_lease() -> None:
    """An entry the entry store refuses for its size is held with the reason; the
    holder's lease goes, another owner's stays (pure)."""
    e = claim(make_entry("a@mixed.example.test"), "mixed.example.test", "w1", T0, 60)
    mine = hold(e, "mixed.example.test", "w1", "too large")
    assert mine.held and mine.last_error == "too large" and not mine.leases
    assert mine.recipients[0].state is RecipientState.PENDING
    theirs = hold(e, "mixed.example.test", "w2", "too large")
    assert theirs.held and "mixed.example.test" in theirs.leases
    assert not e.held, "the input is not changed"


def test_own_lease_of_an_earlier_process_and_a_dead_owners_lease_are_free() -> None:
    """Issue item 4: a running lease whose owner is the checking worker but that it is not
    delivering (it restarted) counts as free; so does one whose owner is known dead; the
    lease of another, present owner names that owner for a presence look-up."""
    e = make_entry("a@mixed.example.test")
    item = WorkItem(e.id, "mixed.example.test", 0)
    claimed = claim(e, "mixed.example.test", "pod-a", T0, lease_s=600)
    at = T0 + timedelta(seconds=10)
    assert check(claimed, item, at, owner="pod-a").verdict is Verdict.DELIVER
    busy = check(claimed, item, at, owner="pod-a", delivering=True)
    assert busy.verdict is Verdict.LATER and busy.leased_by is None
    other = check(claimed, item, at, owner="pod-b")
    assert other.verdict is Verdict.LATER and other.leased_by == "pod-a"
    assert check(claimed, item, at, owner="pod-b", dead_owner="pod-a").verdict is Verdict.DELIVER
    assert check(claimed, item, at, owner="pod-b", dead_owner="pod-c").verdict is Verdict.LATER


def test_flush_breaks_dead_and_forced_leases_and_requeue_keeps_attempts() -> None:
    """A flush breaks the running lease of an owner that is not present, and a live one
    only when asked (with the warning); a requeue drops every lease, keeps attempts."""
    e = make_entry("a@mixed.example.test")
    e.recipients[0].attempts = 2
    claimed = claim(e, "mixed.example.test", "pod-a", T0, lease_s=600)
    at = T0 + timedelta(seconds=10)
    kept, why = flushed(claimed, at)
    assert kept is None and "pod-a" in why
    dead, why = flushed(claimed, at, dead=frozenset({"pod-a"}))
    assert dead is not None and not dead.leases and "not present" in why
    forced, why = flushed(claimed, at, break_live=True)
    assert forced is not None and not forced.leases and "sent twice" in why
    again, why = requeued(claimed, at)
    assert again is not None and not again.leases and "sent twice" in why
    r = again.recipients[0]
    assert r.attempts == 2 and r.state is RecipientState.DEFERRED and r.next_attempt_at == at
    assert again.generation == claimed.generation + 1


def test_a_dead_site_deferral_keeps_the_cause_of_the_last_failure() -> None:
    """RFC 5321 §4.5.4.1: while a site is down its mail is deferred without a connection;
    the recipient's last reply then says so and still names the failure it last had (as
    Postfix's "delivery temporarily suspended: <cause>"), so a DSN at expiry shows the
    cause, and put-backs one after another keep that cause once, never nested."""
    e = make_entry("a@dead.example.test", "b@dead.example.test")
    refused = Reply(code=451, enhanced="4.4.1", text="connection refused", remote_host=None)
    e.recipients[0].last_reply = reply(421, "4.3.2", "too busy")
    e.recipients[1].last_reply = refused
    down = replies.R451_SITE_DOWN.model_copy(
        update={"text": f"{replies.R451_SITE_DOWN.text}: site dead.example.test down until X"}
    )
    first = site_deferred(e, "dead.example.test", down, T0 + timedelta(seconds=300))
    assert first is not None
    a, b = (r.last_reply for r in first.recipients)
    assert a is not None and b is not None
    assert a.text == f"{down.text}; last failure: 421 4.3.2 too busy"
    assert b.text == f"{down.text}; last failure: 451 4.4.1 connection refused"
    assert (a.code, a.enhanced) == (451, "4.4.1")
    later = down.model_copy(update={"text": down.text.replace("until X", "until Y")})
    second = site_deferred(first, "dead.example.test", later, T0 + timedelta(seconds=600))
    assert second is not None
    again = second.recipients[0].last_reply
    assert again is not None
    assert again.text == f"{later.text}; last failure: 421 4.3.2 too busy"
    fresh = make_entry("c@dead.example.test")  # never tried: nothing to keep
    third = site_deferred(fresh, "dead.example.test", down, T0)
    assert third is not None and third.recipients[0].last_reply == down
