"""The SMTP front end: accept mail, store it durably, then answer ``250`` (DESIGN.md §2.1, §4).

Modules: ``server`` (the listening front end, :func:`~jsqueue.frontend.server.serve_smtp`),
``session`` (the aiosmtpd session per connection; ``transaction``, its per-transaction
state), ``ingest`` (body, entry and work items to
the stores; no socket), ``data`` (DATA decoding), ``syntax`` (paths and parameters), ``auth``
(the AUTH password file), ``received`` (the ``Received:`` trace field). Nothing is imported
here, so ``python -m jsqueue.frontend.auth`` runs without loading the rest.
"""
