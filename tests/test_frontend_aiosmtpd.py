"""The aiosmtpd names the front-end session relies on (jsqueue/frontend/session.py).

aiosmtpd is pinned to one minor version in pyproject.toml because the session overrides and
reads private parts of :class:`aiosmtpd.smtp.SMTP`; these tests make an upgrade that renames
or drops one fail loudly instead of silently changing behaviour.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

import aiosmtpd.smtp
import pytest
from aiosmtpd.smtp import SMTP, Envelope, Session

from jsqueue.frontend import session as session_module
from jsqueue.frontend.session import InboundSession
from jsqueue.frontend.transaction import CommandReader

#: Methods of SMTP the session overrides or calls.
METHODS = [
    "connection_made",
    "connection_lost",
    "_handle_client",
    "_timeout_cb",
    "_create_envelope",
    "_set_post_data_state",
    "_set_rset_state",
    "_reset_timeout",
    "push",
    "check_helo_needed",
    "challenge_auth",
    "smtp_EHLO",
    "smtp_HELO",
    "smtp_STARTTLS",
    "smtp_AUTH",
    "smtp_MAIL",
    "smtp_RCPT",
    "smtp_DATA",
]
#: Attributes of an SMTP instance the session reads or replaces.
ATTRIBUTES = [
    "session",
    "envelope",
    "transport",
    "hostname",
    "tls_context",
    "command_size_limits",
    "_original_transport",
    "_tls_protocol",
    "_timeout_handle",
    "_reader",
    "_writer",
    "_smtp_methods",
]
#: Keyword arguments of SMTP.__init__ the session passes.
INIT_KWARGS = [
    "data_size_limit",
    "enable_SMTPUTF8",
    "hostname",
    "ident",
    "tls_context",
    "require_starttls",
    "timeout",
    "auth_require_tls",
    "auth_exclude_mechanism",
    "loop",
]
#: Session and Envelope attributes the session reads or sets.
SESSION_ATTRIBUTES = ["peer", "extended_smtp", "host_name", "authenticated", "auth_data", "ssl"]
ENVELOPE_ATTRIBUTES = ["mail_from", "rcpt_tos"]

_SOURCE = inspect.getsource(SMTP)
_ASSIGNED = set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=", _SOURCE))


def _defined_on_smtp(name: str) -> bool:
    return hasattr(SMTP, name) or name in _ASSIGNED


def test_aiosmtpd_is_the_pinned_minor_version() -> None:
    """pyproject.toml pins aiosmtpd to the minor version these names were checked against."""
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    pin = re.search(r'"aiosmtpd>=(\d+)\.(\d+)\.\d+,<(\d+)\.(\d+)"', pyproject)
    assert pin, "aiosmtpd must be pinned as >=X.Y.Z,<X.(Y+1)"
    major, minor = (int(p) for p in aiosmtpd.__version__.split(".")[:2])
    assert (major, minor) == (int(pin[1]), int(pin[2]))


@pytest.mark.parametrize("name", METHODS)
def test_overridden_or_called_method_exists(name: str) -> None:
    assert callable(getattr(SMTP, name, None)), f"aiosmtpd.smtp.SMTP.{name} is gone"


@pytest.mark.parametrize("name", ATTRIBUTES)
def test_used_attribute_exists(name: str) -> None:
    assert _defined_on_smtp(name), f"aiosmtpd.smtp.SMTP no longer sets self.{name}"


def test_class_level_command_size_limit_exists() -> None:
    """The session's per-instance limits fall back to ``SMTP.command_size_limit``."""
    assert isinstance(SMTP.command_size_limit, int)


def test_init_keywords_exist() -> None:
    params = inspect.signature(SMTP.__init__).parameters
    assert [k for k in INIT_KWARGS if k not in params] == []


async def test_session_and_envelope_attributes_exist() -> None:
    session = Session(asyncio.get_running_loop())
    assert [a for a in SESSION_ATTRIBUTES if not hasattr(session, a)] == []
    envelope = Envelope()
    assert [a for a in ENVELOPE_ATTRIBUTES if not hasattr(envelope, a)] == []


async def test_stream_reader_buffer_exists() -> None:
    """Pipelined commands after DATA go back through ``StreamReader._buffer``."""
    assert isinstance(asyncio.StreamReader()._buffer, bytearray)  # type: ignore[attr-defined]


async def test_command_reader_does_not_shadow_stream_reader_names() -> None:
    """CommandReader's own state lives beside StreamReader's (its class is swapped in on a
    live reader): none of its private names may be one StreamReader uses."""
    reader = asyncio.StreamReader()
    theirs = set(vars(reader)) | set(dir(asyncio.StreamReader))
    own = {n for n in vars(CommandReader) if n.startswith("_") and not n.startswith("__")}
    assert sorted(own & theirs) == []


def test_own_private_names_do_not_shadow_aiosmtpd() -> None:
    """A private helper of the session must not override an aiosmtpd name by accident: every
    private name it defines that SMTP also has is one of the deliberate overrides above."""
    own = {n for n in vars(InboundSession) if n.startswith("_") and not n.startswith("__")}
    own |= set(re.findall(r"self\.(_\w+)\s*(?::[^=\n]+)?=", inspect.getsource(InboundSession)))
    deliberate = set(METHODS) | set(ATTRIBUTES)
    assert sorted(n for n in own - deliberate if _defined_on_smtp(n)) == []


def test_session_sends_no_literal_replies() -> None:
    """Every reply comes from jsqueue/replies.py: no reply line is spelled out here."""
    source = inspect.getsource(session_module)
    assert re.findall(r"\"[2-5]\d\d[ -]", source) == []
