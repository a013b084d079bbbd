"""Published TLS policies of destination domains: MTA-STS (RFC 8461), DANE for SMTP
(RFC 7672), the per-MX decision between them and TLS reporting (RFC 8460)."""
