"""Names: every id and domain is validated before it becomes a subject token or KV key."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from jsqueue.errors import InvalidName
from jsqueue.names import (
    Names,
    check_domain,
    check_queue_id,
    derived_queue_id,
    js_api_subject,
    kv_subject,
    kv_subjects,
    new_queue_id,
    object_chunk_subject,
    object_chunk_subjects,
    object_meta_subject,
    object_meta_subjects,
    object_name_of_meta_subject,
    object_token_subjects,
    queue_id_time,
)

#: A fixed valid id (a fresh one per import would give test ids that differ between runs).
VALID_ID = "01m8tq535znehzeppjv6vmfe26"


def test_new_queue_ids_are_valid_unique_and_sorted_by_time() -> None:
    ids = [new_queue_id(now_ms=1_700_000_000_000 + i) for i in range(50)]
    assert ids == sorted(ids)
    assert len(set(ids)) == 50
    for qid in ids:
        assert check_queue_id(qid) == qid
        assert len(qid) == 26
    assert new_queue_id() != new_queue_id()


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "short",
        VALID_ID + "0",  # too long
        VALID_ID[:-1],  # too short
        VALID_ID.upper(),  # upper case is not what we generate
        VALID_ID[:-1] + ".",
        VALID_ID[:-1] + "*",
        VALID_ID[:-1] + ">",
        VALID_ID[:-1] + " ",
        VALID_ID[:-1] + "u",  # not in Crockford base32
        VALID_ID[:-1] + "/",
        "../../../../etc/passwd0000",
    ],
)
def test_invalid_queue_ids(bad: str) -> None:
    with pytest.raises(InvalidName):
        check_queue_id(bad)
    with pytest.raises(InvalidName):
        Names().work_subject(bad, "example.com")
    with pytest.raises(InvalidName):
        Names().work_subjects_of(bad)


@pytest.mark.parametrize(
    ("domain", "normal"),
    [
        ("example.com", "example.com"),
        ("Mail.Example.COM", "mail.example.com"),
        ("example.com.", "example.com"),
        ("xn--bcher-kva.example.test", "xn--bcher-kva.example.test"),
        ("a-b.example", "a-b.example"),
        ("[127.0.0.1]", "[127.0.0.1]"),
        ("[IPv6:2001:db8::1]", "[ipv6:2001:db8::1]"),
        ("x" * 63 + ".example", "x" * 63 + ".example"),
    ],
)
def test_valid_domains_are_normalised(domain: str, normal: str) -> None:
    assert check_domain(domain) == normal


@pytest.mark.parametrize(
    "bad",
    [
        "",
        ".",
        "a..b",
        "-a.example",
        "a-.example",
        "a b.example",
        "a*.example",
        "*",
        ">",
        "a.>",
        "a_b.example",
        "bücher.example",  # U-labels must be converted first (routing_domain)
        "x" * 64 + ".example",  # label too long
        ".".join(["abcdefgh"] * 30),  # name too long
        "[1.2.3.4",
        "[not-an-ip]",
        "exa\tmple.com",
    ],
)
def test_invalid_domains(bad: str) -> None:
    with pytest.raises(InvalidName):
        check_domain(bad)
    with pytest.raises(InvalidName):
        Names().work_subject(VALID_ID, bad)
    with pytest.raises(InvalidName):
        Names().work_msg_id(VALID_ID, bad, 0)


def test_work_subject_is_one_token_per_part() -> None:
    n = Names("jsq")
    subject = n.work_subject(VALID_ID, "Mail.Example.com")
    assert subject == f"jsq.work.{VALID_ID}.mail_example_com"
    assert subject.split(".")[:3] == ["jsq", "work", VALID_ID]
    assert len(subject.split(".")) == 4
    literal = n.work_subject(VALID_ID, "[IPv6:2001:db8::1]")
    assert len(literal.split(".")) == 4 and not set("*> []:") & set(literal)
    assert n.work_subjects == "jsq.work.>"
    assert n.work_subjects_of(VALID_ID) == f"jsq.work.{VALID_ID}.*"


def test_work_msg_id_identifies_item_and_generation() -> None:
    n = Names()
    assert n.work_msg_id(VALID_ID, "Example.com", 2) == n.work_msg_id(VALID_ID, "example.com", 2)
    assert n.work_msg_id(VALID_ID, "example.com", 2) != n.work_msg_id(VALID_ID, "example.com", 3)


def test_object_names_carry_the_prefix() -> None:
    n = Names("abc")
    assert n.bodies_bucket == "abc-bodies"
    assert n.entries_bucket == "abc-queue"
    assert n.work_stream == "ABC_WORK"
    assert n.work_consumer == "abc-workers"
    assert n.events_stream == "ABC_EVENTS"
    assert n.event_subject("delivered") == "abc.events.delivered"
    assert Names().prefix == "jsq"


@pytest.mark.parametrize("bad", ["", "1abc", "Abc", "a.b", "a b", "a*", "a>", "a" * 33])
def test_invalid_prefixes(bad: str) -> None:
    with pytest.raises(InvalidName):
        Names(bad)


def test_queue_id_time_is_the_creation_time() -> None:
    """The first 10 characters encode the creation time in milliseconds; a derived id
    (a DSN's) carries its base id's time."""
    ms = 1_780_000_000_123
    qid = new_queue_id(ms)
    assert queue_id_time(qid) == datetime.fromtimestamp(ms / 1000, UTC)
    assert queue_id_time(derived_queue_id(qid, "dsn")) == queue_id_time(qid)
    with pytest.raises(InvalidName):
        queue_id_time("not-an-id")


def test_jetstream_wire_names() -> None:
    """The streams and subjects behind KV and object-store buckets, and the API subjects,
    as the NATS wire layouts spell them (every module builds them through names.py)."""
    n = Names("abc")
    assert n.bodies_stream == "OBJ_abc-bodies"
    assert n.entries_stream == "KV_abc-queue"
    assert n.ingest_stream == "KV_abc-ingest"
    assert (n.locks_bucket, n.locks_stream) == ("abc-locks", "KV_abc-locks")
    assert n.reconciler_lock_key == "reconciler"
    assert js_api_subject("STREAM.INFO.X") == "$JS.API.STREAM.INFO.X"
    assert kv_subject("b", "k") == "$KV.b.k"
    assert kv_subjects("b") == "$KV.b.>"
    assert object_chunk_subject("b", "nuid") == "$O.b.C.nuid"
    assert object_chunk_subjects("b") == "$O.b.C.>"
    assert object_meta_subjects("b") == "$O.b.M.>"
    assert object_token_subjects("b", "t") == "$O.b.*.t"
    meta = object_meta_subject("b", VALID_ID)
    assert meta.startswith("$O.b.M.")
    assert object_name_of_meta_subject("b", meta) == VALID_ID
    assert object_name_of_meta_subject("other", meta) is None
    assert object_name_of_meta_subject("b", "$O.b.M.abc") is None  # bad padding
    assert object_name_of_meta_subject("b", "$O.b.M._w==") is None  # not UTF-8


def test_queue_id_of_work_subject_inverts_work_subject() -> None:
    n = Names("abc")
    assert n.queue_id_of_work_subject(n.work_subject(VALID_ID, "example.com")) == VALID_ID
    assert Names("xyz").queue_id_of_work_subject(n.work_subject(VALID_ID, "a.b")) is None
    assert n.queue_id_of_work_subject("abc.work.not-an-id.example_com") is None
    assert n.queue_id_of_work_subject("abc.events.delivered") is None
