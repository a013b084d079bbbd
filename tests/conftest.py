"""Shared pytest fixtures. Keep this small: fixtures live in ``tests/support/*`` modules and
are registered here as plugins (see each module's docstring for what it provides)."""

pytest_plugins = ["support.nats", "support.queue", "support.cluster"]
