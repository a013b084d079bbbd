"""Storage layer: Protocols (:mod:`.base`), JetStream and in-memory implementations."""

from jsqueue.store.base import (
    BodyInfo,
    BodyStore,
    Due,
    EntryStore,
    Scheduler,
    Stores,
    Versioned,
)

__all__ = [
    "BodyInfo",
    "BodyStore",
    "Due",
    "EntryStore",
    "Scheduler",
    "Stores",
    "Versioned",
]
