"""The reply table (jsqueue/replies.py) is data that checks itself (STYLE.md habit 8)."""

from __future__ import annotations

import re

import pytest

from jsqueue import replies
from jsqueue.replies import R452_TOO_MANY_RECIPIENTS, Reply

NAME_RE = re.compile(r"^R(?P<code>[2-5]\d\d)_[A-Z0-9_]+$")
ENHANCED_RE = re.compile(r"^(?P<cls>[245])\.(?P<subject>\d{1,3})\.(?P<detail>\d{1,3})$")

CONSTANTS = {name: value for name, value in vars(replies).items() if isinstance(value, Reply)}


def test_table_is_not_empty() -> None:
    """STYLE.md habit 8: the checks below run over real constants."""
    assert len(CONSTANTS) >= 20


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_name_matches_code(name: str) -> None:
    """RFC 5321 §4.2: each constant is named R<code>_<MEANING> after its basic reply code."""
    match = NAME_RE.match(name)
    assert match, f"{name} is not named R<code>_<MEANING>"
    assert int(match["code"]) == CONSTANTS[name].code


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_enhanced_code_class_matches(name: str) -> None:
    """RFC 3463 §2 / RFC 2034 §4: the enhanced code is class.subject.detail and its class
    digit equals the basic code's first digit."""
    reply = CONSTANTS[name]
    assert reply.enhanced is not None, f"{name} has no enhanced status code"
    match = ENHANCED_RE.match(reply.enhanced)
    assert match, f"{name}: {reply.enhanced!r} is not class.subject.detail"
    assert match["cls"] == str(reply.code)[0]
    assert 0 <= int(match["subject"]) <= 999 and 0 <= int(match["detail"]) <= 999


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_text_is_one_printable_line(name: str) -> None:
    """RFC 5321 §4.2: reply text is printable US-ASCII; a CR or LF would break the reply."""
    text = CONSTANTS[name].text
    assert text and text.isascii() and text.isprintable()


def test_names_are_unique_per_meaning() -> None:
    """STYLE.md habit 8: no two constants carry the same code, enhanced code and text."""
    seen = [(r.code, r.enhanced, r.text) for r in CONSTANTS.values()]
    assert len(seen) == len(set(seen))


def test_sent_is_left_out_of_the_json_unless_set() -> None:
    """Reply.sent (the server's own codes of a reply recorded under another, RFC 5321
    §4.5.3.1.10) costs an entry nothing when unset, and survives the JSON when set."""
    assert "sent" not in R452_TOO_MANY_RECIPIENTS.model_dump_json()
    taken = R452_TOO_MANY_RECIPIENTS.model_copy(update={"sent": "552 5.2.2"})
    assert Reply.model_validate_json(taken.model_dump_json()).sent == "552 5.2.2"
