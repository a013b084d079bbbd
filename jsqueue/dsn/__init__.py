"""Delivery status notifications: :mod:`.report` builds them (RFC 3464, pure),
:mod:`.notifier` enqueues the ones a settled entry owes (I/O)."""
