"""Durations as operators write them: ``90s``, ``30m``, ``12h``, ``14d``, ``2w``.

One parser for every place that reads one (``prune_jobs --older-than``,
``create_ops_token --expires-in``, the retention settings). No Django imports: the
settings module uses it too.
"""

from __future__ import annotations

import re
from datetime import timedelta

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
EXAMPLES = "e.g. 14d, 12h, 30m, 90s, 2w"
#: A century: longer would put ``now - duration`` (a retention cut-off) or ``now +
#: duration`` (a token's expiry) outside the dates the databases and Python hold.
MAXIMUM = timedelta(days=36_500)


def parse(text: str) -> timedelta:
    """``text`` as a timedelta; ValueError (saying what is wrong) otherwise."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([smhdw])", text, re.ASCII)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (use {EXAMPLES})")
    seconds = float(match[1]) * UNITS[match[2]]
    if seconds > MAXIMUM.total_seconds():
        raise ValueError(f"duration {text!r} is too long (at most 100 years, 36500d)")
    return timedelta(seconds=seconds)
