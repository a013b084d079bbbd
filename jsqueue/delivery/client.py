"""One outbound SMTP delivery attempt for one destination domain: :func:`deliver_domain`
resolves the domain, :func:`deliver` tries its targets in order, one
:class:`~jsqueue.delivery.session.OutboundSession` each, and returns one reply per recipient;
it never raises library errors. The rules (TLS policies, capability checks, when to move on to
the next MX, the connection cache, timeouts) are in ``docs/architecture.md`` (Delivery).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

from jsqueue.config import WorkerSettings
from jsqueue.delivery.base import BodySource, DeliveryEnvelope, DeliveryResult
from jsqueue.delivery.body import BodyCache
from jsqueue.delivery.connections import ConnectionCache
from jsqueue.delivery.dkim import DkimSigner
from jsqueue.delivery.policy.decision import PolicyEngine, TlsPlan
from jsqueue.delivery.policy.notes import fallback_note, last_failure, refused_reply, with_note
from jsqueue.delivery.resolver import MxTarget, Resolver, without_myself
from jsqueue.delivery.responses import with_detail
from jsqueue.delivery.session import LoopsBack, NextMx, OutboundSession, TlsFallback
from jsqueue.errors import DeliveryError
from jsqueue.replies import R451_CONNECT_FAILED, R554_LOOPS_BACK, Reply, TlsNote

__all__ = ["deliver", "deliver_domain"]

log = logging.getLogger(__name__)


async def deliver_domain(
    resolver: Resolver,
    envelope: DeliveryEnvelope,
    body: BodySource,
    settings: WorkerSettings,
    cache: ConnectionCache | None = None,
    engine: PolicyEngine | None = None,
    signer: DkimSigner | None = None,
) -> DeliveryResult:
    """Resolve ``envelope.domain``, decide each MX's TLS policy (``engine``; the configured
    ``worker.tls`` alone when None) and :func:`deliver`; resolver errors become replies.
    Not idempotent: it may send the message.

    Args:
        resolver: MX (or smarthost) resolution (RFC 5321 §5.1, RFC 7505).
        envelope: reverse-path, recipients of one domain and the message's flags.
        body: the raw message.
        settings: the ``worker`` settings section.
        cache: sessions to reuse; None = QUIT after each.
        engine: decides DANE / MTA-STS / opportunistic per MX (RFC 7672, RFC 8461).
        signer: DKIM signer; None = unsigned.

    Returns:
        as :func:`deliver`; on a DNS failure every recipient gets the resolver's reply
        (e.g. ``550 5.1.10`` null MX, ``451 4.4.3`` SERVFAIL) and no connection is made.
    """
    try:
        targets = await resolver.resolve(envelope.domain)
    except DeliveryError as e:
        return DeliveryResult(replies={r.address: e.reply for r in envelope.recipients})
    plans = await engine.plans(envelope.domain, targets) if engine is not None else None
    return await deliver(targets, envelope, body, settings, cache, plans, signer)


async def deliver(
    targets: Sequence[MxTarget],
    envelope: DeliveryEnvelope,
    body: BodySource,
    settings: WorkerSettings,
    cache: ConnectionCache | None = None,
    plans: Mapping[str, TlsPlan] | None = None,
    signer: DkimSigner | None = None,
) -> DeliveryResult:
    """Run one delivery attempt over ``targets`` in order, one session each, until one
    completes a transaction (RFC 5321 §5.1); the rules are in ``docs/architecture.md``
    (Delivery, One SMTP attempt). Not idempotent: it may send the message.

    Args:
        targets: addresses to try in order (at most one transaction succeeds).
        envelope: reverse-path, recipients of one domain and the message's flags.
        body: the raw message; opened once per session that sends DATA.
        settings: timeouts (seconds), TLS policy, EHLO name, MX port, smarthost AUTH.
        cache: sessions to reuse and to give the session back to; None = QUIT after each.
        plans: the TLS plan per MX host name (:mod:`.policy.decision`); a plan that
            refuses its MX skips it with ``4.7.5``. None = ``worker.tls`` alone.
        signer: DKIM signer (``worker.dkim``): signs the bytes each session sends (after
            any 7-bit conversion); None = unsigned.

    Returns:
        one reply per recipient address (each carrying the session's TLS note);
        never raises for network, protocol or TLS errors.
        Targets at ``worker.own_addresses`` and every one of the same or a lower
        preference are dropped first (RFC 5321 §5.1); when none is left, every recipient
        gets ``554 5.4.6`` "loops back to myself".
        When every target failed, every recipient gets the last target's failure (e.g.
        ``451 4.4.1``, worded for the smarthost when the target is one) and ``tried_host``
        names that target; except those a target refused (RCPT 4yz/5yz) before it failed
        (``NextMx.settled``): they keep that reply and are not offered to the next target.
    """
    recipients = list({r.address: r for r in envelope.recipients}.values())
    if not recipients:
        return DeliveryResult(replies={})
    if not targets:
        reply = with_detail(R451_CONNECT_FAILED, "no mail exchanger to try")
        return DeliveryResult(replies={r.address: reply for r in recipients})
    targets, myself = without_myself(targets, settings.own_addresses)
    if myself is not None:
        detail = (
            f"mail for {envelope.domain} loops back to myself: {myself.host} "
            f"[{myself.address}] is one of worker.own_addresses"
        )
        log.error("%s; %d better MX target(s) left", detail, len(targets))
        if not targets:  # this queue is the best MX: a permanent failure (RFC 3463 X.4.6)
            reply = with_detail(R554_LOOPS_BACK, detail)
            return DeliveryResult(
                replies={r.address: reply for r in recipients}, tried_host=myself.host
            )
    body_cache = BodyCache(body, signer, envelope.reverse_path)
    last: Reply | None = None  # every target that did not return set it
    earlier: list[TlsNote] = []  # TLS notes of the sessions that failed (RFC 8460 counts)
    loop: Reply | None = None
    settled: dict[str, Reply] = {}  # refused by a target that failed afterwards
    for target in targets:
        if loop is not None or not recipients:
            break
        allow_tls = True
        fresh = False  # after a desynchronised session: a new connection, not a cached one
        plan = (plans or {}).get(target.host)
        if plan is not None and plan.refuse is not None:
            log.warning("%s [%s]: not used: %s", target.host, target.address, plan.refuse.detail)
            last = refused_reply(target, plan.refuse)
            earlier.append(plan.refuse)
            continue
        while True:
            session = OutboundSession(
                target, envelope, recipients, body_cache, settings, allow_tls, fresh, plan
            )
            try:
                result = await session.run(cache)
            except TlsFallback as e:
                log.warning(
                    "%s [%s]: STARTTLS failed (%s); retrying in plaintext (opportunistic TLS)",
                    target.host,
                    target.address,
                    e,
                )
                allow_tls = False
                earlier.append(fallback_note(plan, session, e))
                continue
            except LoopsBack as e:
                # RFC 5321 §5.1: this target and every one after it (the same or a lower
                # preference) are dropped.
                log.error("%s [%s]: %s", target.host, target.address, e.reply)
                loop = e.reply
                break
            except NextMx as e:
                log.info(
                    "%s [%s]: %s; trying the next %s",
                    target.host,
                    target.address,
                    e.reply,
                    "address of the smarthost" if target.relay else "MX",
                )
                last = e.reply
                earlier.extend([e.reply.tls] if e.reply.tls else [])
                refusals = DeliveryResult(replies=e.settled, tls=session.tls)
                settled.update(with_note(refusals, session).replies)
                recipients = [r for r in recipients if r.address not in settled]
                break
            if session.desynced_unsent:
                # Out of sync before any body went out (greeting, EHLO, MAIL, RCPT, DATA):
                # nobody has the message. Once more on a new connection (a cached session
                # may have gone stale), then the next MX, as for a malformed reply.
                if not fresh:
                    fresh = True
                    continue
                last = with_note(result, session).replies[recipients[0].address]
                earlier.extend([last.tls] if last.tls else [])
                log.info(
                    "%s [%s]: out of sync again; trying the next %s",
                    target.host,
                    target.address,
                    "address of the smarthost" if target.relay else "MX",
                )
                break
            result = with_note(await _rest(result, session, cache), session, earlier)
            return replace(result, replies={**settled, **result.replies})
    if loop is not None and last is None:
        # The best target is this queue itself: a permanent failure (RFC 3463 X.4.6),
        # bounced, never retried. With a better target tried and failed, the attempt is
        # deferred with that target's failure instead.
        return DeliveryResult(replies={r.address: loop for r in recipients}, tried_host=target.host)
    failed = last_failure(last, earlier) or with_detail(
        R451_CONNECT_FAILED, "no mail exchanger answered"
    )
    tried = targets[-1].host
    replies = {**settled, **{r.address: failed for r in recipients}}
    return DeliveryResult(replies=replies, tried_host=tried)


async def _rest(
    result: DeliveryResult, session: OutboundSession, cache: ConnectionCache | None
) -> DeliveryResult:
    """Recipients a recipient limit left over (RFC 5321 §4.5.3.1.10) after their session
    ended go at once in a new session to the same target, while each session accepts
    someone (each leaves fewer); so do those of a transaction whose replies got out of sync
    (a fresh connection, once). A follow-up session that fails before accepting anyone
    leaves them with their temporary reply (the limit's, or ``4.5.0``), but those it
    refused before it failed keep that refusal (``NextMx.settled``, RFC 5321 §3.3)."""
    while session.carry:
        pending = session.carry
        log.info(
            "%s: %d recipient(s) over the recipient limit; new session",
            session.where(),
            len(pending),
        )
        session = OutboundSession(
            session.target,
            session.envelope,
            pending,
            session.body,
            session.settings,
            session.allow_tls,
            fresh=session.desynced,
            plan=session.plan,
        )
        try:
            more = await session.run(cache)
        except (NextMx, TlsFallback) as e:
            log.info("%s: follow-up session failed: %s", session.where(), e)
            if isinstance(e, NextMx) and e.settled:
                result = replace(result, replies={**result.replies, **e.settled})
            break
        result = replace(
            result,
            replies={**result.replies, **more.replies},
            uncertain=result.uncertain | more.uncertain,
            dsn_accepted=result.dsn_accepted | more.dsn_accepted,
        )
    return result
