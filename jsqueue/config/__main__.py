"""``python -m jsqueue.config`` prints the settings reference (``docs/configuration.md``)."""

from jsqueue.config.reference import settings_reference

print(settings_reference(), end="")
