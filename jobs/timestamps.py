"""Times as the outside writes them: ISO 8601 / RFC 3339 with a UTC offset.

One reading for every place that takes one from outside (``enqueue --run-at``, the API's
``since``, a spool submission's ``submitted_at``), so the same text is the same instant,
or the same refusal, everywhere. No Django imports.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

# The characters an ISO 8601 time can hold (a space is RFC 3339's allowed separator);
# anything else (a NUL, a newline) is refused before parsing.
_TEXT = re.compile(r"[0-9A-Za-z:.,+\- ]{1,64}", re.ASCII)
_LEAP_SECOND = re.compile(r"(T\d{2}:\d{2}):60", re.ASCII)


class InvalidTime(ValueError):
    """Not an ISO 8601 time, or outside the dates Python can hold in UTC."""


class NaiveTime(InvalidTime):
    """An ISO 8601 time without a UTC offset: which instant it means is unknown."""


class OutOfRange(InvalidTime):
    """A valid ISO 8601 time whose instant falls outside years 1 to 9999 in UTC."""


def parse(text: str) -> datetime:
    """``text`` as an aware datetime in UTC; InvalidTime (NaiveTime, OutOfRange) otherwise.

    RFC 3339 also allows a lower-case ``t`` and ``z``; a leap second (``:60``) is read as
    ``:59``. Digits past the microsecond are cut (Python's precision).
    """
    if not isinstance(text, str) or not _TEXT.fullmatch(text):
        raise InvalidTime(f"not an ISO 8601 time: {text!r}")
    normal = _LEAP_SECOND.sub(r"\1:59", text.upper())
    try:
        parsed = datetime.fromisoformat(normal)
    except ValueError:
        raise InvalidTime(f"not an ISO 8601 time: {text!r}") from None
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise NaiveTime(f"{text!r} has no UTC offset (add Z or +hh:mm)")
    try:
        return parsed.astimezone(UTC)
    except (OverflowError, ValueError):  # e.g. 0001-01-01T00:00:00+01:00: before year 1
        raise OutOfRange(f"{text!r} is outside the years 1 to 9999 in UTC") from None
