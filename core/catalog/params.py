"""The parts every catalogue entry is made of: a bounded parameter and the error a
user's bad choice raises. Free of torch, like the whole catalogue."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from core.errors import UserError

# The most values a list parameter holds: one per rotated pair of the widest head
# (head_dim <= 4096).
MAX_LIST_VALUES = 2048


class EncodingConfigError(UserError, ValueError):
    """A user asked for an encoding, parameter or scaling that does not exist or is out of range."""


def is_positive_int(value: Any) -> bool:
    """An int of at least 1 (True is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: error messages never echo a huge input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 4]}... ({len(text):,} characters)"


@dataclass(frozen=True)
class Param:
    """One tunable parameter of an encoding, with its type, default and bounds. A ``list``
    parameter is a list of numbers, each within the bounds (one per rotated pair, say)."""

    name: str
    type: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] | None = None
    # A default of None means "derived from the model" (e.g. the training length).
    derived: str | None = None
    # An optional parameter stays out of the resolved parameters until it is given, so one
    # added after results existed changes no stored parameter and no hash while unset.
    optional: bool = False

    def allowed(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        kind = "list of numbers, each" if self.type is list else self.type.__name__

        def shown(bound: float) -> str:  # an integer's bound in digits, not 4.1943e+06
            return f"{int(bound)}" if self.type is int else f"{bound:g}"

        if self.low is not None and self.high is not None:
            return f"{kind} in [{shown(self.low)}, {shown(self.high)}]"
        if self.low is not None:
            return f"{kind} >= {shown(self.low)}"
        if self.high is not None:
            return f"{kind} <= {shown(self.high)}"
        return kind

    def check(self, owner: str, value: Any) -> Any:
        """Return ``value`` coerced to this parameter's type, or raise a readable error."""
        where = f"{owner}: parameter {short_repr(self.name)}"
        if self.type is list:
            return self._check_list(where, value)
        if self.type is bool:
            if not isinstance(value, bool):
                raise EncodingConfigError(f"{where} must be true or false, got {short_repr(value)}")
        elif self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                else:
                    raise EncodingConfigError(
                        f"{where} must be an integer ({self.allowed()}), got {short_repr(value)}"
                    )
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise EncodingConfigError(
                    f"{where} must be a number ({self.allowed()}), got {short_repr(value)}"
                )
            value = float(value)
            if not math.isfinite(value):
                raise EncodingConfigError(f"{where} must be finite, got {short_repr(value)}")
        elif self.type is str and not isinstance(value, str):
            raise EncodingConfigError(
                f"{where} must be a string ({self.allowed()}), got {short_repr(value)}"
            )
        if self.choices is not None and value not in self.choices:
            raise EncodingConfigError(f"{where} must be {self.allowed()}, got {short_repr(value)}")
        if self.low is not None and value < self.low:
            raise EncodingConfigError(f"{where} must be {self.allowed()}, got {short_repr(value)}")
        if self.high is not None and value > self.high:
            raise EncodingConfigError(f"{where} must be {self.allowed()}, got {short_repr(value)}")
        return value

    def _check_list(self, where: str, value: Any) -> list[float]:
        if not isinstance(value, list | tuple) or not value:
            raise EncodingConfigError(
                f"{where} must be a non-empty list ({self.allowed()}), got {short_repr(value)}"
            )
        if len(value) > MAX_LIST_VALUES:
            raise EncodingConfigError(
                f"{where} holds {len(value):,} values; at most {MAX_LIST_VALUES:,}"
            )
        item = Param(self.name, float, None, self.help, low=self.low, high=self.high)
        checked = []
        for index, number in enumerate(value):
            try:
                checked.append(item.check("", number))
            except EncodingConfigError as err:
                reason = str(err).partition(" must be ")[2]
                raise EncodingConfigError(f"{where}: value {index} must be {reason}") from None
        return checked

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type.__name__,
            "default": self.default,
            "derived_from": self.derived,
            "min": self.low,
            "max": self.high,
            "choices": list(self.choices) if self.choices is not None else None,
            "help": self.help,
        }
