"""The API's body parser: DRF's JSON parser, with a body nested too deeply refused as bad
input (a 400) instead of ending in Python's ``RecursionError`` (a 500), and a number too
long for Python's integer parsing named as such."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import IO, Any

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONParser(parsers.JSONParser):
    def parse(
        self,
        stream: IO[Any],
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body is nested too deeply") from None
        except ParseError as exc:
            # Python's own limit on a number's digits, named without its internals.
            if "int_max_str_digits" in str(exc.detail):
                limit = sys.get_int_max_str_digits()
                raise ParseError(
                    f"JSON parse error - a number has more than {limit} digits"
                ) from None
            raise
