"""Outbound TLS: the client TLS context a session uses for STARTTLS, per the destination's
policy (``worker.tls``, ``worker.tls_policies``; RFC 3207, RFC 7435). The policy decisions
(MTA-STS, DANE) that choose it are to come here as well.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from jsqueue.config import TlsPolicy


def client_context(policy: TlsPolicy, ca_file: Path | None = None) -> ssl.SSLContext:
    """The TLS context for STARTTLS under ``policy``.

    ``verify`` checks the certificate chain (against ``ca_file``, else the system's CAs)
    and the host name; every other policy encrypts against passive listeners only and
    accepts any certificate (RFC 7435 §1.3: opportunistic security).

    Args:
        policy: the destination's TLS policy.
        ca_file: PEM file of trusted CAs for ``verify``; the system's when None.

    Returns:
        a new context (not shared between sessions).

    Raises:
        OSError: ``ca_file`` cannot be read.
        ssl.SSLError: ``ca_file`` holds no usable certificate.
    """
    if policy is TlsPolicy.VERIFY:
        return ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx
