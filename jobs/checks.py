"""System checks: a misconfigured lane or schedule is reported by ``manage.py check``."""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured


@checks.register()
def check_lanes_and_schedules(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    from . import lanes, schedules

    errors: list[checks.CheckMessage] = []
    try:
        lanes.lanes()
    except (ValueError, TypeError) as exc:
        errors.append(checks.Error(str(exc), obj="HOLDFAST_LANES", id="holdfast.E001"))
    try:
        # Not the providers: they read rows, and checks also run before ``migrate``.
        schedules.declared(providers=False)
    except ImproperlyConfigured as exc:
        errors.append(checks.Error(str(exc), obj="HOLDFAST_SCHEDULES", id="holdfast.E002"))
    return errors
