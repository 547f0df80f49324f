"""Content negotiation for the API: DRF's, honouring ``q=0``.

``Accept: application/json;q=0, text/html`` says "anything but JSON" (RFC 9110, 12.4.2:
a weight of 0 means not acceptable); DRF ignores weights, so it answered JSON. JSON is
the only format here, so such a request is a 406 like ``Accept: text/html``.
"""

from __future__ import annotations

import re
from typing import Any

from rest_framework.negotiation import DefaultContentNegotiation

_ZERO_WEIGHT = re.compile(r";\s*q\s*=\s*0(\.0{0,3})?\s*(;|$)", re.ASCII | re.IGNORECASE)


class ContentNegotiation(DefaultContentNegotiation):
    def get_accept_list(self, request: Any) -> list[str]:
        return [
            token for token in super().get_accept_list(request) if not _ZERO_WEIGHT.search(token)
        ]
