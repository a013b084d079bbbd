"""The entry model: lossless JSON, UTC timestamps, derived state, routing domains."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from jsqueue.envelope import (
    Entry,
    EntryState,
    Lease,
    Notify,
    Recipient,
    RecipientState,
    routing_domain,
    utcnow,
)
from jsqueue.errors import InvalidName
from jsqueue.names import new_queue_id
from jsqueue.replies import Reply

T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def entry_with(*states: RecipientState, held: bool = False) -> Entry:
    return Entry(
        id=new_queue_id(),
        reverse_path="a@example.org",
        recipients=[
            Recipient(address=f"r{i}@example.com", domain="example.com", state=s)
            for i, s in enumerate(states)
        ],
        created_at=T0,
        size=1,
        held=held,
    )


def test_json_round_trip_is_lossless() -> None:
    entry = Entry(
        id=new_queue_id(),
        reverse_path="",
        recipients=[
            Recipient(
                address="Jörg@bücher.example.test",
                domain=routing_domain("Jörg@bücher.example.test"),
                orcpt="utf-8;J\u00f6rg@b\u00fccher.example.test",
                notify=frozenset({Notify.FAILURE, Notify.DELAY}),
                state=RecipientState.DEFERRED,
                attempts=3,
                last_attempt_at=T0,
                next_attempt_at=T0 + timedelta(minutes=20),
                last_reply=Reply(
                    code=451, enhanced="4.7.1", text="greylisted\nline 2", remote_host="mx.b"
                ),
                delay_notified_at=T0,
                dsn_sent=True,
            ),
            Recipient(address="x@[127.0.0.1]", domain="[127.0.0.1]"),
        ],
        created_at=T0,
        size=12345,
        digest="ab" * 32,
        helo="client.example",
        client_address="192.0.2.1",
        envid="env+2Did",
        ret="HDRS",
        smtputf8=True,
        body_8bit=True,
        generation=7,
        held=True,
        last_error="boom",
        leases={"example.com": Lease(owner="worker-1", until=T0 + timedelta(minutes=10))},
        is_dsn=True,
        request_digest="cd" * 32,
    )
    data = entry.to_json()
    assert isinstance(data, bytes)
    again = Entry.from_json(data)
    assert again == entry
    assert again.to_json() == data


def test_an_entry_without_a_request_digest_stores_no_such_field() -> None:
    """``request_digest`` (HTTP inject with an Idempotency-Key) is left out of the stored
    form when None, as for all SMTP mail: entries do not grow by a ``null`` each."""
    entry = entry_with(RecipientState.PENDING)
    assert b"request_digest" not in entry.to_json()
    assert Entry.from_json(entry.to_json()).request_digest is None


def test_next_hop_dsn_is_stored_only_when_set_and_old_entries_load() -> None:
    """RFC 3461 §5.2.1: ``Recipient.next_hop_dsn`` (the next hop took NOTIFY/ORCPT and
    reports success itself) round-trips when True, is left out of the stored form when
    False, and an entry stored before the field existed loads with it False."""
    entry = entry_with(RecipientState.DELIVERED, RecipientState.DELIVERED)
    assert b"next_hop_dsn" not in entry.to_json()
    entry.recipients[0].next_hop_dsn = True
    data = entry.to_json()
    assert data.count(b'"next_hop_dsn":true') == 1
    again = Entry.from_json(data)
    assert [r.next_hop_dsn for r in again.recipients] == [True, False]
    old = (
        b'{"id":"01jq0000000000000000000000","reverse_path":"a@example.org","recipients":'
        b'[{"address":"r@example.com","domain":"example.com","state":"delivered",'
        b'"attempts":1,"dsn_sent":false}],"created_at":"2026-01-02T03:04:05Z","size":1}'
    )
    assert Entry.from_json(old).recipients[0].next_hop_dsn is False


@pytest.mark.parametrize(
    "body",
    [b"", b"Subject: x\r\n\r\nline\r\n", b'\n\n{"id": 1}\n', bytes(range(256)) * 40],
)
def test_inline_body_travels_after_the_json_line(body: bytes) -> None:
    """An inline body (``smtp.inline_body_max``) follows the entry's JSON line unchanged
    (LF, NUL and 8-bit octets included); it is neither in the JSON nor in the repr."""
    entry = entry_with(RecipientState.PENDING).model_copy(update={"inline_body": body})
    data = entry.to_json()
    line, sep, rest = data.partition(b"\n")
    assert sep == b"\n" and rest == body
    assert b"inline_body" not in line and "inline_body" not in entry.model_dump()
    assert repr(body) not in repr(entry)
    again = Entry.from_json(data)
    assert again == entry and again.inline_body == body
    assert again.to_json() == data
    stored_apart = Entry.from_json(line)  # the same entry without it: body in the body store
    assert stored_apart.inline_body is None and b"\n" not in stored_apart.to_json()


def test_timestamps_are_utc_and_naive_is_rejected() -> None:
    plus2 = timezone(timedelta(hours=2))
    local = datetime(2026, 1, 2, 5, 4, 5, tzinfo=plus2)
    e = entry_with(RecipientState.PENDING).model_copy(update={"created_at": local})
    e = Entry.model_validate(e.model_dump())
    assert e.created_at.tzinfo == UTC
    assert e.created_at == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    with pytest.raises(ValidationError):
        Entry(
            id=new_queue_id(),
            reverse_path="",
            recipients=[],
            created_at=datetime(2026, 1, 2, 3, 4, 5),
            size=0,
        )
    with pytest.raises(ValidationError):
        Recipient(address="a@b.c", domain="b.c", next_attempt_at=datetime(2026, 1, 1))
    assert utcnow().tzinfo == UTC


@pytest.mark.parametrize(
    ("states", "held", "expected"),
    [
        ((RecipientState.PENDING,), False, EntryState.PENDING),
        ((RecipientState.DEFERRED, RecipientState.PENDING), False, EntryState.PENDING),
        ((RecipientState.DEFERRED, RecipientState.ACTIVE), False, EntryState.ACTIVE),
        ((RecipientState.DEFERRED, RecipientState.DELIVERED), False, EntryState.DEFERRED),
        ((RecipientState.DELIVERED, RecipientState.BOUNCED), False, EntryState.DONE),
        ((RecipientState.FAILED,), False, EntryState.DONE),
        ((RecipientState.DEFERRED,), True, EntryState.HELD),
        ((RecipientState.ACTIVE,), True, EntryState.HELD),
        ((RecipientState.DELIVERED,), True, EntryState.DONE),  # nothing left to hold
    ],
)
def test_state_is_derived_from_recipients(
    states: tuple[RecipientState, ...], held: bool, expected: EntryState
) -> None:
    entry = entry_with(*states, held=held)
    assert entry.state == expected
    assert entry.is_final == all(s.is_final for s in states)


def test_due_at_and_open_recipients() -> None:
    e = entry_with(RecipientState.DEFERRED, RecipientState.DEFERRED, RecipientState.DELIVERED)
    e.recipients[0].next_attempt_at = T0 + timedelta(minutes=30)
    e.recipients[1].next_attempt_at = T0 + timedelta(minutes=10)
    assert e.due_at("example.com") == T0 + timedelta(minutes=10)
    assert [r.address for r in e.open_recipients("example.com")] == [
        "r0@example.com",
        "r1@example.com",
    ]
    assert e.due_at("other.example") is None
    pending = entry_with(RecipientState.PENDING)
    assert pending.due_at("example.com") == T0  # due at once
    done = entry_with(RecipientState.DELIVERED)
    assert done.due_at("example.com") is None


def test_domains_in_first_seen_order() -> None:
    e = Entry(
        id=new_queue_id(),
        reverse_path="a@b.c",
        recipients=[
            Recipient.from_address(a) for a in ("x@b.example", "y@a.example", "z@B.example")
        ],
        created_at=T0,
        size=0,
    )
    assert e.domains == ["b.example", "a.example"]


@pytest.mark.parametrize(
    ("address", "domain"),
    [
        ("user@bücher.example.test", "xn--bcher-kva.example.test"),
        ("user@BÜCHER.Example.Test", "xn--bcher-kva.example.test"),
        ("Jörg@example.com", "example.com"),  # the local part is never touched
        ("user@Example.COM.", "example.com"),
        ('"a@b"@example.org', "example.org"),
        ("postmaster@[192.0.2.1]", "[192.0.2.1]"),
        ("u@[IPv6:2001:db8::1]", "[ipv6:2001:db8::1]"),
        # one host, one destination: RFC 4291 spellings of an address as RFC 5952's
        ("u@[IPv6:0:0:0:0:0:0:0:1]", "[ipv6:::1]"),
        ("u@[ipv6:2001:DB8:0:0::0001]", "[ipv6:2001:db8::1]"),
    ],
)
def test_routing_domain(address: str, domain: str) -> None:
    assert routing_domain(address) == domain
    assert Recipient.from_address(address).domain == domain


@pytest.mark.parametrize(
    "address", ["no-at-sign", "user@", "user@exa mple.com", "user@a..b", "user@*.example", "u@>"]
)
def test_routing_domain_rejects(address: str) -> None:
    with pytest.raises(InvalidName):
        routing_domain(address)


def test_reply_classes_and_text() -> None:
    r = Reply(code=250, enhanced="2.0.0", text="ok\nqueued", remote_host="mx")
    assert r.is_success and not r.is_temporary and not r.is_permanent
    assert str(r) == "250 2.0.0 ok queued"
    assert Reply(code=421).is_temporary and str(Reply(code=421)) == "421"
    assert Reply(code=550, text="no").is_permanent
    with pytest.raises(ValidationError):
        Reply(code=199)
