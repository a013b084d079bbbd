"""Retry policy (jsqueue/retry.py): RFC 5321 §4.5.4.1 backoff, expiry, DST, skew, jitter."""

from __future__ import annotations

import random
from collections import Counter
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jsqueue.config import RetrySettings
from jsqueue.retry import (
    Expire,
    ExpiryReason,
    Retry,
    RetryPolicy,
    delay_until_s,
    is_due,
)

BERLIN = ZoneInfo("Europe/Berlin")
LOS_ANGELES = ZoneInfo("America/Los_Angeles")
T0 = datetime(2026, 3, 2, 9, 0, 5, tzinfo=UTC)


def _retry(decision: Retry | Expire) -> Retry:
    assert isinstance(decision, Retry), decision
    return decision


def test_backoff_doubles_from_base_and_caps_at_max() -> None:
    """RFC 5321 §4.5.4.1 / DESIGN.md §5: base·factor^(n-1), capped at max."""
    p = RetryPolicy(base_s=300, factor=2, max_delay_s=4 * 3600, jitter=0)
    assert [p.backoff_s(n) for n in range(1, 8)] == [
        300,
        600,
        1200,
        2400,
        4800,
        9600,
        14400,
    ]
    assert p.backoff_s(10_000) == 14400  # no float overflow on huge attempt counts
    with pytest.raises(ValueError):
        p.backoff_s(0)


def test_from_settings_uses_bounce_lifetime_for_dsns() -> None:
    """RFC 5321 §4.5.4.1: DSNs may have a shorter lifetime (bounce_max_age_s)."""
    s = RetrySettings(max_age_s=5 * 86400, bounce_max_age_s=86400, jitter=0.2, max_attempts=9)
    normal = RetryPolicy.from_settings(s)
    dsn = RetryPolicy.from_settings(s, dsn=True)
    assert normal.max_age_s == 5 * 86400
    assert dsn.max_age_s == 86400
    assert (normal.base_s, normal.factor, normal.max_delay_s) == (s.base_s, s.factor, 14400)
    assert normal.jitter == dsn.jitter == 0.2
    assert normal.max_attempts == 9


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_s": 0},
        {"factor": 0.5},
        {"jitter": 1.0},
        {"jitter": -0.1},
        {"max_attempts": 0},
        {"min_delay_s": 0},
        {"max_age_s": -1},
    ],
)
def test_invalid_policy_rejected(kwargs: dict[str, float]) -> None:
    """Policy values out of range raise ValueError at construction."""
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]  # the values are deliberately wrong


def test_naive_datetimes_rejected() -> None:
    """DESIGN.md habit 4: only aware datetimes; a naive one is a bug, not local time."""
    p = RetryPolicy()
    rng = random.Random(1)
    with pytest.raises(ValueError):
        p.after_failure(attempt=1, created_at=T0, now=datetime(2026, 3, 2, 9), rng=rng)
    with pytest.raises(ValueError):
        p.after_failure(attempt=1, created_at=datetime(2026, 3, 2), now=T0, rng=rng)
    with pytest.raises(ValueError):
        p.after_failure(attempt=0, created_at=T0, now=T0, rng=rng)


def test_case27_a_time_zone_of_the_worker_does_not_matter() -> None:
    """CASE-27 A (RFC 5321 §4.5.4.1): 900 s constant delay, the same instant whatever the
    zone of the clock reading (Los Angeles vs UTC); never ~8 h off, never immediate."""
    p = RetryPolicy(base_s=900, factor=1.0, jitter=0)
    rng = random.Random(0)
    first_failure = datetime(2026, 3, 2, 9, 0, 7, tzinfo=UTC)
    utc_view = _retry(p.after_failure(attempt=1, created_at=T0, now=first_failure, rng=rng))
    la_view = _retry(
        p.after_failure(
            attempt=1,
            created_at=T0.astimezone(LOS_ANGELES),
            now=first_failure.astimezone(LOS_ANGELES),
            rng=rng,
        )
    )
    assert utc_view.at == la_view.at == first_failure + timedelta(seconds=900)
    assert utc_view.at.utcoffset() == la_view.at.utcoffset() == timedelta(0)
    assert utc_view.delay_s == la_view.delay_s == 900
    # The second retry is again 900 s later (factor 1.0).
    second = _retry(p.after_failure(attempt=2, created_at=T0, now=utc_view.at, rng=rng))
    assert second.at - utc_view.at == timedelta(seconds=900)


@pytest.mark.parametrize(
    ("failure_local", "due_utc", "due_local"),
    [
        # Spring: 01:30 CET + 1 h; 02:30 local does not exist that night.
        (
            datetime(2026, 3, 29, 1, 30, tzinfo=BERLIN),
            datetime(2026, 3, 29, 1, 30, tzinfo=UTC),
            datetime(2026, 3, 29, 3, 30, tzinfo=BERLIN),
        ),
        # Autumn: 02:30 CEST (first pass) + 1 h = 02:30 CET (second pass, fold=1).
        (
            datetime(2026, 10, 25, 2, 30, fold=0, tzinfo=BERLIN),
            datetime(2026, 10, 25, 1, 30, tzinfo=UTC),
            datetime(2026, 10, 25, 2, 30, fold=1, tzinfo=BERLIN),
        ),
    ],
    ids=["spring", "autumn"],
)
def test_case27_c_dst_transitions_use_utc_instants(
    failure_local: datetime, due_utc: datetime, due_local: datetime
) -> None:
    """CASE-27 C (RFC 5321 §4.5.4.1): retry 3600 s after a failure at a DST transition in
    Europe/Berlin lands exactly one elapsed hour later, on both nights."""
    p = RetryPolicy(base_s=3600, factor=1.0, jitter=0)
    created = failure_local - timedelta(minutes=5)
    decision = _retry(
        p.after_failure(attempt=1, created_at=created, now=failure_local, rng=random.Random(0))
    )
    assert decision.at == due_utc
    assert decision.at.utcoffset() == timedelta(0)
    shown = decision.at.astimezone(BERLIN)
    assert (shown.hour, shown.minute, shown.fold) == (
        due_local.hour,
        due_local.minute,
        due_local.fold,
    )
    assert shown.utcoffset() == due_local.utcoffset()
    assert decision.delay_s == 3600


def test_case27_c_wall_clock_arithmetic_would_be_wrong_in_autumn() -> None:
    """CASE-27 C: guards the test above; Python's aware+timedelta is wall-clock arithmetic, one
    hour late in autumn, which is exactly what the policy must not do."""
    failure = datetime(2026, 10, 25, 2, 30, fold=0, tzinfo=BERLIN)
    wall = failure + timedelta(hours=1)
    assert wall.astimezone(UTC) == datetime(2026, 10, 25, 2, 30, tzinfo=UTC)  # one hour late


def test_case27_d_synchronised_failures_spread_out() -> None:
    """CASE-27 D (DESIGN.md §5, no retry storms): 10 000 failures in the same second with 20 %
    jitter spread over >= 20 % of the delay window; no second holds more than 2 %."""
    p = RetryPolicy(base_s=300, factor=2, jitter=0.2)
    rng = random.Random(27)
    now = datetime(2026, 3, 2, 9, 0, 7, tzinfo=UTC)
    ats = [
        _retry(p.after_failure(attempt=1, created_at=T0, now=now, rng=rng)).at
        for _ in range(10_000)
    ]
    offsets = [(a - now).total_seconds() for a in ats]
    assert min(offsets) >= 300 * 0.8
    assert max(offsets) <= 300 * 1.2
    assert max(offsets) - min(offsets) >= 0.2 * 300
    per_second = Counter(int(a.timestamp()) for a in ats)
    assert max(per_second.values()) <= 200  # 2 % of 10 000


def test_case27_d_capped_delays_still_spread() -> None:
    """DESIGN.md §5: jitter applies after the cap, so capped retries do not pile up on
    max_delay_s."""
    p = RetryPolicy(base_s=300, factor=2, max_delay_s=3600, jitter=0.2)
    rng = random.Random(5)
    delays = [p.delay_s(50, rng) for _ in range(2000)]
    assert max(Counter(round(d) for d in delays).values()) <= 40
    assert min(delays) >= 0.8 * 3600 and max(delays) <= 1.2 * 3600


def test_case27_e_expiry_counts_from_acceptance() -> None:
    """CASE-27 E (RFC 5321 §4.5.4.1): accepted at T, first attempt at T+3600 s, lifetime 2 h:
    the last attempt is at T+7200 s and its failure expires the recipient; nothing is ever
    scheduled after the deadline."""
    p = RetryPolicy(base_s=900, factor=2, max_age_s=7200, jitter=0.1)
    rng = random.Random(3)
    now = T0 + timedelta(seconds=3600)
    attempts = 1
    schedule = []
    while True:
        decision = p.after_failure(attempt=attempts, created_at=T0, now=now, rng=rng)
        if isinstance(decision, Expire):
            break
        schedule.append(decision.at)
        now, attempts = decision.at, attempts + 1
    assert decision.reason is ExpiryReason.MAX_AGE
    assert decision.deadline == T0 + timedelta(seconds=7200)
    assert now == T0 + timedelta(seconds=7200)  # expired after the final try at the deadline
    assert all(at <= decision.deadline for at in schedule)
    assert len(schedule) >= 2


def test_expires_when_lifetime_is_over() -> None:
    """RFC 5321 §4.5.4.1: a failure at or after acceptance + max_age expires at once."""
    p = RetryPolicy(max_age_s=3600)
    d = p.after_failure(
        attempt=1, created_at=T0, now=T0 + timedelta(seconds=3600), rng=random.Random(0)
    )
    assert isinstance(d, Expire) and d.reason is ExpiryReason.MAX_AGE


def test_expires_when_too_little_time_remains() -> None:
    """Expiry rule: less than min_delay_s before the deadline means expire, not a retry a
    fraction of a second later."""
    p = RetryPolicy(base_s=300, max_age_s=3600, jitter=0, min_delay_s=1.0)
    now = T0 + timedelta(seconds=3599.5)
    d = p.after_failure(attempt=3, created_at=T0, now=now, rng=random.Random(0))
    assert isinstance(d, Expire)
    later = p.after_failure(
        attempt=3, created_at=T0, now=T0 + timedelta(seconds=3500), rng=random.Random(0)
    )
    assert _retry(later).at == T0 + timedelta(seconds=3600)
    assert _retry(later).delay_s == pytest.approx(100)


def test_expires_after_max_attempts() -> None:
    """DESIGN.md §5: the optional attempt limit expires the recipient on its last failure."""
    p = RetryPolicy(max_attempts=3, jitter=0)
    rng = random.Random(0)
    assert isinstance(p.after_failure(attempt=2, created_at=T0, now=T0, rng=rng), Retry)
    d = p.after_failure(attempt=3, created_at=T0, now=T0, rng=rng)
    assert isinstance(d, Expire) and d.reason is ExpiryReason.MAX_ATTEMPTS


def test_case27_b_fast_clock_bounded() -> None:
    """CASE-27 B (DESIGN.md §2.2): a worker 600 s fast stores the due time as an instant; a
    correct worker re-NAKs until then, and the fast worker itself takes a redelivery at most
    600 s early, i.e. >= 300 s after the failure with a 900 s delay."""
    skew = timedelta(seconds=600)
    p = RetryPolicy(base_s=900, factor=1.0, jitter=0)
    failure_true = T0 + timedelta(seconds=2)
    # W1 (correct) records the failure: due at failure + 900 s.
    due = _retry(
        p.after_failure(attempt=1, created_at=T0, now=failure_true, rng=random.Random(0))
    ).at
    # An early redelivery (crash -> ack_wait 60 s) reaches W2, whose clock reads 600 s ahead.
    early_true = failure_true + timedelta(seconds=60)
    assert not is_due(due, early_true + skew)
    assert delay_until_s(due, early_true + skew) == pytest.approx(900 - 60 - 600)
    # W2 would take it at true time failure + 300 s at the earliest.
    assert is_due(due, failure_true + timedelta(seconds=300) + skew)
    assert not is_due(due, failure_true + timedelta(seconds=298) + skew)
    # Expiry judged by W2 is early by at most the skew: 10 s before (deadline - skew) it
    # still retries, at (deadline - skew) it expires.
    short = RetryPolicy(base_s=900, factor=1.0, jitter=0, max_age_s=7200)
    w2_deadline_true = T0 + timedelta(seconds=7200) - skew
    before = short.after_failure(
        attempt=5,
        created_at=T0,
        now=w2_deadline_true - timedelta(seconds=10) + skew,
        rng=random.Random(0),
    )
    assert isinstance(before, Retry)
    at = short.after_failure(
        attempt=5, created_at=T0, now=w2_deadline_true + skew, rng=random.Random(0)
    )
    assert isinstance(at, Expire)


@given(
    attempt=st.integers(min_value=1, max_value=10_000),
    age_s=st.floats(min_value=-86400, max_value=10 * 86400, allow_nan=False),
    jitter=st.floats(min_value=0, max_value=0.5),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_never_a_delay_at_or_below_zero(
    attempt: int, age_s: float, jitter: float, seed: int
) -> None:
    """CASE-27 B: whatever the clocks say (now even before acceptance), a retry is at least
    min_delay_s in the future and never after the deadline."""
    p = RetryPolicy(jitter=jitter)
    now = T0 + timedelta(seconds=age_s)
    d = p.after_failure(attempt=attempt, created_at=T0, now=now, rng=random.Random(seed))
    if isinstance(d, Retry):
        assert d.delay_s >= p.min_delay_s
        assert d.at > now
        assert d.at <= p.deadline(T0)
        assert (d.at - now).total_seconds() == pytest.approx(d.delay_s)
    else:
        assert now + timedelta(seconds=p.min_delay_s) >= d.deadline


def test_tiny_configured_delays_are_raised_to_the_minimum() -> None:
    """CASE-27 B: even a sub-second base delay never yields a retry sooner than min_delay_s."""
    p = RetryPolicy(base_s=0.2, factor=1.0, jitter=0.5, min_delay_s=1.0)
    rng = random.Random(9)
    assert min(p.delay_s(1, rng) for _ in range(100)) == 1.0
    d = _retry(p.after_failure(attempt=1, created_at=T0, now=T0, rng=rng))
    assert d.delay_s == 1.0 and d.at == T0 + timedelta(seconds=1)


def test_is_due_recognises_early_redelivery() -> None:
    """DESIGN.md §2.2: an item redelivered before its stored due time is not due."""
    due = T0 + timedelta(seconds=900)
    assert is_due(None, T0)
    assert not is_due(due, T0 + timedelta(seconds=60))
    assert is_due(due, due - timedelta(seconds=0.5))  # within the 1 s tolerance
    assert not is_due(due, due - timedelta(seconds=2))
    assert is_due(due, due - timedelta(seconds=5), tolerance_s=5)
    assert is_due(due.astimezone(BERLIN), due.astimezone(LOS_ANGELES))
    with pytest.raises(ValueError):
        is_due(due, datetime(2026, 3, 2, 9))


def test_delay_until_never_zero() -> None:
    """DESIGN.md §2.2: re-NAK delays come from the stored instant and are never <= 0."""
    due = T0 + timedelta(seconds=900)
    assert delay_until_s(due, T0) == 900
    assert delay_until_s(due, due) == 1.0
    assert delay_until_s(due, due + timedelta(hours=1)) == 1.0
    assert delay_until_s(due, due, min_delay_s=0.25) == 0.25


@given(st.floats(min_value=0.001, max_value=30.0))
def test_expiring_from_is_where_a_failure_stops_being_retried(margin_s: float) -> None:
    """:meth:`RetryPolicy.expiring_from` (which :func:`jsqueue.state.settled` waits from for
    one expiry DSN, RFC 3464 §2) agrees with :meth:`RetryPolicy.after_failure`: a failure
    from that instant on expires its recipient, one before it is retried."""
    policy = RetryPolicy(base_s=60, factor=2, max_delay_s=3600, max_age_s=600, jitter=0)
    start = policy.expiring_from(T0)
    assert start == policy.deadline(T0) - timedelta(seconds=policy.min_delay_s)
    rng = random.Random(0)
    after = policy.after_failure(
        attempt=3, created_at=T0, now=start + timedelta(seconds=margin_s), rng=rng
    )
    before = policy.after_failure(
        attempt=3, created_at=T0, now=start - timedelta(seconds=margin_s), rng=rng
    )
    assert isinstance(after, Expire) and isinstance(before, Retry)
