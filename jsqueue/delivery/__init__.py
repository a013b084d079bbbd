"""Delivery adapters: MX resolution (:mod:`.resolver`), one SMTP attempt per destination
(:mod:`.client`, over :mod:`.session`, :mod:`.commands`, :mod:`.pipelining`,
:mod:`.connections`, :mod:`.body`, :mod:`.params`, :mod:`.responses`), the pure
transformations it needs (:mod:`.transform`), the worker's deliverer (:mod:`.deliverer`) and
the types they share (:mod:`.base`); e.g.
``await deliver_domain(resolver, DeliveryEnvelope.from_entry(entry, domain), body,
settings.worker, ConnectionCache())`` gives a reply for every recipient of the domain.
"""

from jsqueue.delivery.base import (
    Attempt,
    BodySource,
    Deliverer,
    DeliveryEnvelope,
    DeliveryResult,
)
from jsqueue.delivery.client import deliver, deliver_domain
from jsqueue.delivery.connections import ConnectionCache
from jsqueue.delivery.deliverer import SmtpDeliverer
from jsqueue.delivery.resolver import (
    DnsResolver,
    MxTarget,
    Resolver,
    SmarthostResolver,
    StaticResolver,
    resolver_from_settings,
)
from jsqueue.delivery.responses import to_reply

__all__ = [
    "Attempt",
    "BodySource",
    "ConnectionCache",
    "Deliverer",
    "DeliveryEnvelope",
    "DeliveryResult",
    "DnsResolver",
    "MxTarget",
    "Resolver",
    "SmarthostResolver",
    "SmtpDeliverer",
    "StaticResolver",
    "deliver",
    "deliver_domain",
    "resolver_from_settings",
    "to_reply",
]
