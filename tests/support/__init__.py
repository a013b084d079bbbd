"""Test harness shared by the delivery and worker tests: real servers on loopback only.

* :mod:`support.dns` - :class:`~support.dns.DnsServer`, an authoritative DNS
  server (UDP+TCP) fed with zone-file-style text like the cases' ``dns.txt``.
* :mod:`support.mx` - :class:`~support.mx.SmtpdMx` (aiosmtpd-based) and
  :class:`~support.mx.ScriptedMx` (raw, fully scripted) fake MX servers,
  :func:`~support.mx.shared_port`, :func:`~support.mx.trap` and
  :class:`~support.mx.Certs` (trustme certificates).

Nothing here contacts or resolves a real domain.
"""
