"""JSON text from outside, read strictly: what ``json.loads`` would accept but no job,
body or submission should hold is refused with a reason an operator can act on.

Shared by ``manage.py enqueue --args`` and the API's body parser (``ops.parsers``).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def strict_constant(name: str) -> Any:
    """``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (DRF's ``STRICT_JSON``)."""
    raise ValueError(f"{name} is not valid JSON")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object naming a key twice is refused: JSON leaves it undefined, and Python would
    keep the last one silently."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"the key {key!r} is given more than once")
        found[key] = value
    return found


def loads(text: str) -> Any:
    """``text`` as JSON, strictly; ValueError with a one-line reason otherwise (also for
    a document nested too deeply, or a number too long for Python's integers)."""
    try:
        return json.loads(text, parse_constant=strict_constant, object_pairs_hook=unique_keys)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as exc:
        raise ValueError(reason(exc)) from None


def reason(exc: ValueError) -> str:
    """The one-line reason of a JSON parse error, Python's internals left out."""
    if "int_max_str_digits" in str(exc):
        return f"a number has more than {sys.get_int_max_str_digits()} digits"
    return str(exc)
