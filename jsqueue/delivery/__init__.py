"""Delivery adapters: MX resolution (:mod:`.resolver`), the SMTP client (:mod:`.client`)
and the pure message transformations it needs (:mod:`.transform`).

Typical use by the worker::

    resolver = resolver_from_settings(settings.worker)
    result = await deliver_domain(resolver, DeliveryEnvelope.from_entry(entry, domain),
                                  BodySource(open=..., size=entry.size), settings.worker,
                                  ConnectionCache())  # sessions kept between deliveries
    result.replies  # {address: Reply} for every recipient of the domain
"""

from jsqueue.delivery.client import (
    BodySource,
    ConnectionCache,
    DeliveryEnvelope,
    DeliveryResult,
    deliver,
    deliver_domain,
)
from jsqueue.delivery.resolver import (
    DnsResolver,
    MxTarget,
    Resolver,
    SmarthostResolver,
    StaticResolver,
    resolver_from_settings,
)

__all__ = [
    "BodySource",
    "ConnectionCache",
    "DeliveryEnvelope",
    "DeliveryResult",
    "DnsResolver",
    "MxTarget",
    "Resolver",
    "SmarthostResolver",
    "StaticResolver",
    "deliver",
    "deliver_domain",
    "resolver_from_settings",
]
