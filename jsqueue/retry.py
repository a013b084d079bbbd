"""Retry policy: when to try a deferred recipient again, or when to give up. Pure, no I/O.

After a temporary failure (4yz reply, timeout, DNS SERVFAIL ...) the worker asks
:meth:`RetryPolicy.after_failure` what to do and gets either a :class:`Retry` (an absolute UTC
instant plus the NAK delay that reaches it) or an :class:`Expire` (bounce with ``4.4.7``,
RFC 3463 §3.5). The schedule follows RFC 5321 §4.5.4.1 and DESIGN.md §5::

    delay(n) = min(base_s * factor ** (n - 1), max_delay_s) * (1 + u),  u ~ U(-jitter, +jitter)

where ``n`` is the number of failed attempts so far (1 after the first failure).

Decisions made here, in one place:

* **UTC instants only.** Every datetime is converted to UTC before any arithmetic, so local
  time zones and DST transitions cannot move a retry: an hour after 2026-03-29T00:30Z is
  01:30Z whatever the wall clock says (Python adds timedeltas to *wall-clock* time for
  datetimes in a ``ZoneInfo`` zone, which is exactly the DST bug this avoids).
* **Jitter is applied after the cap** (``max_delay_s`` is the centre of the last window, so
  a capped delay may reach ``max_delay_s * (1 + jitter)``). Clamping after the jitter would
  pile every capped retry onto one instant again. Delays are not rounded, so a batch of
  failures in the same second spreads over the whole jitter window (no retry storms).
* **Expiry counts from acceptance** (``Entry.created_at``), never from the first attempt:
  a message accepted at T with ``max_age_s`` = 7200 expires at T + 7200 even if no worker ran
  before T + 3600.
* **Last attempt at the deadline.** When the next attempt would fall after the deadline, it
  is scheduled *at* the deadline (one final try); the failure of that try expires the
  recipient. If less than ``min_delay_s`` remains, the recipient expires at once instead of
  being retried a fraction of a second later.
* **Never a delay <= 0.** A retry is always at least ``min_delay_s`` (default 1 s) in the
  future, so a bad clock can never turn into an immediate retry loop.

Clock skew between workers is bounded because the due time is stored as an *absolute*
instant in KV (``Recipient.next_attempt_at``) and every worker derives its NAK delay from it
(:func:`delay_until_s`) and checks it on arrival (:func:`is_due`). A worker whose clock runs
``s`` seconds ahead stores due times ``s`` seconds late (a correct worker then re-NAKs until
the true instant) and may take a redelivered item at most ``s`` seconds early; it may also
expire a recipient at most ``s`` seconds early. It never retries immediately, because the
delay it computes is never below ``min_delay_s``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum

from jsqueue.config import RetrySettings

MIN_DELAY_S = 1.0
"""Smallest delay, seconds, ever returned for a retry or a re-NAK."""


def _utc(value: datetime, name: str) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be a timezone-aware datetime")
    return value.astimezone(UTC)


class ExpiryReason(StrEnum):
    """Why a recipient ran out of retries."""

    MAX_AGE = "max_age"
    MAX_ATTEMPTS = "max_attempts"


@dataclass(frozen=True, slots=True)
class Retry:
    """Try again.

    Attributes:
        at: the absolute due instant, aware UTC; store it as ``Recipient.next_attempt_at``.
        delay_s: seconds from ``now`` to ``at`` (>= the policy's ``min_delay_s``); the NAK delay.
    """

    at: datetime
    delay_s: float


@dataclass(frozen=True, slots=True)
class Expire:
    """Give up: bounce the recipient with ``4.4.7`` (RFC 3463 §3.5, RFC 5321 §4.5.4.1).

    Attributes:
        reason: lifetime exceeded or attempt limit reached.
        deadline: end of the queue lifetime, aware UTC (acceptance + ``max_age_s``).
    """

    reason: ExpiryReason
    deadline: datetime


Decision = Retry | Expire


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter and a lifetime (DESIGN.md §5, RFC 5321 §4.5.4.1).

    Attributes:
        base_s: delay after the first failure, seconds (RFC 5321 suggests >= 30 min; the
            default 5 min suits greylisting).
        factor: growth per further failure (1.0 = constant delay).
        max_delay_s: cap of the un-jittered delay, seconds.
        max_age_s: queue lifetime counted from acceptance, seconds (RFC 5321: 4-5 days).
        max_attempts: expire after this many failed attempts; None = no limit.
        jitter: each delay is multiplied by a uniform factor in ``[1 - jitter, 1 + jitter]``.
        min_delay_s: lower bound of every returned delay, seconds.

    Raises:
        ValueError: on construction, when a value is out of range (non-positive durations,
            ``factor`` < 1, ``jitter`` outside ``[0, 1)``, ``max_attempts`` < 1).
    """

    base_s: float = 300.0
    factor: float = 2.0
    max_delay_s: float = 4 * 3600.0
    max_age_s: float = 5 * 86400.0
    max_attempts: int | None = None
    jitter: float = 0.1
    min_delay_s: float = MIN_DELAY_S

    def __post_init__(self) -> None:
        if not (self.base_s > 0 and self.max_delay_s > 0 and self.max_age_s > 0):
            raise ValueError("base_s, max_delay_s and max_age_s must be > 0")
        if not self.factor >= 1.0:
            raise ValueError("factor must be >= 1")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError("jitter must be in [0, 1)")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1 or None")
        if not self.min_delay_s > 0:
            raise ValueError("min_delay_s must be > 0")

    @classmethod
    def from_settings(cls, settings: RetrySettings, *, dsn: bool = False) -> RetryPolicy:
        """Build the policy from configuration.

        Args:
            settings: the ``retry`` settings section.
            dsn: the entry is a DSN (null reverse-path); its lifetime is
                ``settings.bounce_max_age_s`` instead of ``max_age_s``.

        Returns:
            the policy.
        """
        return cls(
            base_s=settings.base_s,
            factor=settings.factor,
            max_delay_s=settings.max_delay_s,
            max_age_s=settings.bounce_max_age_s if dsn else settings.max_age_s,
            max_attempts=settings.max_attempts,
            jitter=settings.jitter,
        )

    def backoff_s(self, attempt: int) -> float:
        """The un-jittered delay after ``attempt`` failed attempts, seconds.

        Raises:
            ValueError: ``attempt`` < 1.
        """
        if attempt < 1:
            raise ValueError("attempt counts failed attempts and starts at 1")
        # Compare in log space first: factor ** 100_000 would overflow a float.
        steps = attempt - 1
        if self.base_s >= self.max_delay_s or (
            steps and steps * math.log(self.factor) >= math.log(self.max_delay_s / self.base_s)
        ):
            return self.max_delay_s
        return min(self.base_s * self.factor**steps, self.max_delay_s)

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        """The jittered delay after ``attempt`` failed attempts, seconds (>= ``min_delay_s``).

        Args:
            attempt: failed attempts so far, >= 1.
            rng: source of the jitter; not used when ``jitter`` is 0.

        Raises:
            ValueError: ``attempt`` < 1.
        """
        delay = self.backoff_s(attempt)
        if self.jitter:
            delay *= 1.0 + rng.uniform(-self.jitter, self.jitter)
        return max(delay, self.min_delay_s)

    def deadline(self, created_at: datetime) -> datetime:
        """End of the queue lifetime: acceptance + ``max_age_s``, aware UTC.

        This is also the DSN ``Will-Retry-Until`` value (RFC 3464 §2.3.9).

        Raises:
            ValueError: ``created_at`` is naive.
        """
        return _utc(created_at, "created_at") + timedelta(seconds=self.max_age_s)

    def expiring_from(self, created_at: datetime) -> datetime:
        """The first instant at which a temporary failure expires its recipient by the
        lifetime instead of being retried (:meth:`after_failure`): the deadline less
        ``min_delay_s``. From then on a message's expiry DSN waits for the final tries
        still owed to its other recipients (:func:`jsqueue.state.settled`).

        Raises:
            ValueError: ``created_at`` is naive.
        """
        return self.deadline(created_at) - timedelta(seconds=self.min_delay_s)

    def after_failure(
        self, *, attempt: int, created_at: datetime, now: datetime, rng: random.Random
    ) -> Decision:
        """Decide what follows a temporary failure: retry at an instant, or expire.

        Pure: the same inputs (and ``rng`` state) give the same answer.

        Args:
            attempt: failed attempts of the recipient including this one (1 after the first).
            created_at: when the front end accepted the message (``Entry.created_at``);
                expiry counts from here (RFC 5321 §4.5.4.1).
            now: the current time, timezone-aware (any zone; converted to UTC).
            rng: source of the jitter.

        Returns:
            :class:`Expire` when ``now`` >= the deadline, when ``attempt`` >= ``max_attempts``,
            or when less than ``min_delay_s`` remains before the deadline; otherwise
            :class:`Retry` at ``now + delay`` (UTC), or at the deadline when that would be
            later. ``Retry.delay_s`` is always >= ``min_delay_s`` and ``Retry.at`` > ``now``.

        Raises:
            ValueError: ``attempt`` < 1, or ``created_at`` / ``now`` is naive.
        """
        if attempt < 1:
            raise ValueError("attempt counts failed attempts and starts at 1")
        now_utc = _utc(now, "now")
        deadline = self.deadline(created_at)
        if now_utc >= deadline:
            return Expire(ExpiryReason.MAX_AGE, deadline)
        if self.max_attempts is not None and attempt >= self.max_attempts:
            return Expire(ExpiryReason.MAX_ATTEMPTS, deadline)
        delay = self.delay_s(attempt, rng)
        at = now_utc + timedelta(seconds=delay)
        if at > deadline:
            remaining = (deadline - now_utc).total_seconds()
            if remaining <= self.min_delay_s:
                return Expire(ExpiryReason.MAX_AGE, deadline)
            return Retry(deadline, remaining)
        return Retry(at, delay)


def is_due(next_attempt_at: datetime | None, now: datetime, *, tolerance_s: float = 1.0) -> bool:
    """Whether a recipient's stored due time has come (recognises early redelivery).

    JetStream may redeliver a NAKed work item before its delay ran out (after a crash, at
    ``ack_wait``: DESIGN.md §7); the worker must then re-NAK instead of sending.

    Args:
        next_attempt_at: the stored due instant; None means "due now" (never tried).
        now: the current time, timezone-aware.
        tolerance_s: seconds of earliness still treated as due (timer granularity); keep it
            no larger than the policy's ``min_delay_s``.

    Returns:
        True when ``now >= next_attempt_at - tolerance_s``.

    Raises:
        ValueError: a naive datetime.
    """
    if next_attempt_at is None:
        return True
    due = _utc(next_attempt_at, "next_attempt_at")
    return _utc(now, "now") >= due - timedelta(seconds=tolerance_s)


def delay_until_s(at: datetime, now: datetime, *, min_delay_s: float = MIN_DELAY_S) -> float:
    """The NAK delay that reaches the absolute instant ``at`` from ``now``, seconds.

    Use it to re-NAK an early redelivery: the delay comes from the instant stored in KV, so a
    restart or another worker never stretches or shortens the schedule.

    Args:
        at: the due instant, timezone-aware.
        now: the current time, timezone-aware.
        min_delay_s: lower bound of the result, seconds (never 0: no hot loop).

    Returns:
        ``max(at - now, min_delay_s)`` in seconds.

    Raises:
        ValueError: a naive datetime.
    """
    remaining = (_utc(at, "at") - _utc(now, "now")).total_seconds()
    return max(remaining, min_delay_s)
