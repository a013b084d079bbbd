"""The JetStream backend of the stores: entry points here, one module per part (:mod:`.api`,
:mod:`.provisioning`, :mod:`.connection`, :mod:`.bodies`, :mod:`.entries`, :mod:`.work`,
:mod:`.ingest`, :mod:`.inventory`, :mod:`.lock`); docs/architecture.md, "Storage on
JetStream", describes the layout and the rules every write follows.
"""

from jsqueue.store.jetstream.connection import (
    close_nats,
    connect_nats,
    open_jetstream,
    queue_backlog,
)
from jsqueue.store.jetstream.provisioning import provision

__all__ = ["close_nats", "connect_nats", "open_jetstream", "provision", "queue_backlog"]
