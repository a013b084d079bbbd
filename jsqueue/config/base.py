"""The base of every settings section (:class:`_Section`): unknown keys are errors, a
boolean is never a number, and no number is infinite or NaN. Its own module so that
section modules (e.g. :mod:`jsqueue.config.dkim`) and :mod:`jsqueue.config.sections` can
both import it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

__all__ = ["_Section"]


class _Section(BaseModel):
    """A settings section: unknown keys are errors (a typo in a TOML file or a
    ``JSQUEUE_<SECTION>__<NAME>`` variable must not be silently ignored), and so are
    ``inf`` and ``nan`` (TOML has them, pydantic reads them from text): no setting means
    anything by them, and they failed far from the setting (an OverflowError when a
    duration became nanoseconds, a timer that never fires)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: object, info: ValidationInfo) -> object:
        """``true``/``false`` (TOML, JSON) is not a number; pydantic would read it as 1/0.

        Raises:
            ValueError: a boolean given for an int or float setting.
        """
        numeric = info.field_name is not None and cls.model_fields[info.field_name].annotation in (
            int,
            float,
        )
        if isinstance(value, bool) and numeric:
            raise ValueError("expected a number, not true/false")
        return value
