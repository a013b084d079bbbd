"""What the API's handlers share: settings, the queue's stores, the NATS URLs (for the events
stream), the observer that publishes events, and the tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from jsqueue.admin import Admin
from jsqueue.config import Settings
from jsqueue.events import Observer
from jsqueue.http.auth import Token, TokenFile
from jsqueue.http.inject import Injector
from jsqueue.store.base import Stores


@dataclass
class ApiContext:
    """The API's shared state; one per HTTP endpoint.

    Attributes:
        settings: all settings.
        stores: the queue's stores (the process's own connection).
        urls: NATS server URLs (the events stream is followed on a connection of its own).
        observer: publishes every change to the events stream (and metrics).
        tokens: the bearer tokens.
        injector: the HTTP inject path.
    """

    settings: Settings
    stores: Stores
    urls: list[str]
    observer: Observer
    tokens: TokenFile
    injector: Injector = field(init=False)

    def __post_init__(self) -> None:
        self.injector = Injector(self.settings, self.stores, self.observer)

    def admin(self, token: Token) -> Admin:
        """The queue operations acting as ``token`` (events' source ``api:<name>``)."""
        return Admin(self.stores, self.observer, source=token.source)
