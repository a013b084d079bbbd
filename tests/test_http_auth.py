"""Bearer tokens: the hashed tokens file, its re-reading, roles, and the message helpers of
injection (line ends, Bcc removal for ``jsqueue inject -t``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from jsqueue.cli.mail_commands import header_recipients
from jsqueue.errors import ConfigError, RequestRejected
from jsqueue.http import auth
from jsqueue.http.auth import Role, Token, TokenFile, add_token, parse_tokens, token_line
from jsqueue.http.message import crlf


def test_roles_admin_implies_read_only() -> None:
    read, admin, inject = (Token("x", r) for r in Role)
    assert read.allows(Role.READ) and not read.allows(Role.ADMIN)
    assert not read.allows(Role.INJECT)
    assert admin.allows(Role.READ) and admin.allows(Role.ADMIN)
    assert not admin.allows(Role.INJECT)
    assert inject.allows(Role.INJECT)
    assert not inject.allows(Role.READ) and not inject.allows(Role.ADMIN)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("ops:admin:sha256:abc\n", "expected 'name:role"),
        ("ops:root:sha256:" + "0" * 64 + "\n", "root"),
        ("-ops:read:sha256:" + "0" * 64 + "\n", "invalid token name"),
        ("a:read:sha256:" + "0" * 64 + "\na:admin:sha256:" + "1" * 64 + "\n", "twice"),
    ],
)
def test_malformed_tokens_file_is_one_line_naming_it(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as e:
        parse_tokens(text, "tokens")
    assert str(e.value).startswith("tokens:")


def test_comments_and_blank_lines() -> None:
    line = token_line("ops", Role.ADMIN, "jsq_secret")
    tokens = parse_tokens(f"# operators\n\n{line}\n")
    assert list(tokens.values()) == [Token("ops", Role.ADMIN)]


def test_bad_file_at_start_stops_the_process(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    with pytest.raises(ConfigError, match=r"api\.tokens_file"):
        TokenFile(path)  # missing
    path.write_text("garbage\n")
    with pytest.raises(ConfigError, match=r"api\.tokens_file"):
        TokenFile(path)


def test_file_is_reread_and_fails_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "RECHECK_S", 0.0)
    path = tmp_path / "tokens"
    first = add_token(path, "one", Role.READ)
    tokens = TokenFile(path)
    assert tokens.authenticate(first) == Token("one", Role.READ)
    assert tokens.authenticate(first + "x") is None
    # a Secret update: a new file swapped in
    new = tmp_path / "tokens.new"
    second = add_token(new, "two", Role.INJECT)
    os.replace(new, path)
    assert tokens.authenticate(second) == Token("two", Role.INJECT)
    assert tokens.authenticate(first) is None  # revoked
    path.write_text("broken line\n")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert tokens.authenticate(second) is None  # fail closed
    path.write_text(token_line("two", Role.INJECT, second) + "\n")
    time.sleep(0.01)
    assert tokens.authenticate(second) == Token("two", Role.INJECT)


def test_no_tokens_file_accepts_nothing() -> None:
    assert TokenFile(None).authenticate("jsq_anything") is None


def test_crlf() -> None:
    assert crlf(b"a\nb\n") == b"a\r\nb\r\n"
    assert crlf(b"a\r\nb\nc") == b"a\r\nb\r\nc\r\n"
    assert crlf(b"a\r\nb\r\n") == b"a\r\nb\r\n"
    with pytest.raises(RequestRejected, match="bare CR"):
        crlf(b"a\rb\r\n")
    assert crlf(b"x" * 998 + b"\r\n")
    with pytest.raises(RequestRejected, match="998"):
        crlf(b"x" * 999 + b"\r\n")


def test_header_recipients_removes_bcc_only() -> None:
    msg = (
        b"To: a@x.example, B <b@x.example>\r\n"
        b"bcc: c@x.example,\r\n"
        b"\td@x.example\r\n"
        b"Subject: Bcc: not a field here\r\n"
        b"Cc: e@x.example\r\n"
        b"BCC \t: f@x.example\r\n"  # RFC 5322 §4.5.3 obs-bcc: white space before the colon
        b"CC : g@x.example\r\n"
        b"\r\n"
        b"Bcc: in the body stays\r\n"
    )
    found, kept = header_recipients(msg)
    assert found == [
        "a@x.example", "b@x.example", "e@x.example", "g@x.example", "c@x.example", "d@x.example",
        "f@x.example",
    ]  # fmt: skip
    assert kept == (
        b"To: a@x.example, B <b@x.example>\r\n"
        b"Subject: Bcc: not a field here\r\n"
        b"Cc: e@x.example\r\n"
        b"CC : g@x.example\r\n"
        b"\r\n"
        b"Bcc: in the body stays\r\n"
    )
