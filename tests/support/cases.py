"""The shared delivery and front-end cases, copied into ``tests/cases/`` so the suite runs
from a clean checkout alone. Each folder's ``expected.txt`` is what the tests assert."""

from __future__ import annotations

from pathlib import Path

CASES = Path(__file__).resolve().parent.parent / "cases"


def case_file(case: str, name: str) -> bytes:
    """The bytes of ``tests/cases/<case>/<name>``."""
    return (CASES / case / name).read_bytes()


def case_text(case: str, name: str) -> str:
    """The text of ``tests/cases/<case>/<name>`` (UTF-8)."""
    return case_file(case, name).decode()


def case_message(case: str, name: str = "message.eml") -> bytes:
    """A case's ``.eml`` message with CRLF line ends, as a client would submit it."""
    data = case_file(case, name).replace(b"\r\n", b"\n")
    return data.replace(b"\n", b"\r\n")
