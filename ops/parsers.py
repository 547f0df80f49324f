"""The API's body parser: DRF's JSON parser, with a body nested too deeply refused as bad
input (a 400) instead of ending in Python's ``RecursionError`` (a 500), a number too
long for Python's integer parsing named as such, and an object that names a key twice
refused (JSON leaves it undefined; Python would keep the last one silently)."""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping
from typing import IO, Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError

from jobs.strict_json import reason, strict_constant, unique_keys


class JSONParser(parsers.JSONParser):
    def parse(
        self,
        stream: IO[Any],
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        # DRF's check: only a text codec (a charset such as bz2_codec would decompress the
        # body after its size was checked).
        encoding = parsers.get_encoding(parser_context or {})  # type: ignore[attr-defined]
        try:
            return json.load(
                codecs.getreader(encoding)(stream),
                parse_constant=strict_constant,
                object_pairs_hook=unique_keys,
            )
        except RecursionError:
            raise ParseError("JSON parse error - the body is nested too deeply") from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {reason(exc)}") from None
