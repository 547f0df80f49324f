"""What ``pause_schedule`` and ``resume_schedule`` share."""

from collections.abc import Callable
from typing import Any

from django.core.management.base import CommandParser

from jobs.management.base import JobsCommand
from jobs.models import Schedule
from jobs.serialization import timestamp


class ScheduleToggleCommand(JobsCommand):
    """Apply ``action(name, actor)`` to one schedule and print its state."""

    action: Callable[..., Schedule]

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("name")

    def handle(self, *args: Any, **options: Any) -> None:
        row = self.action(options["name"], actor="cli")
        if options["as_json"]:
            self.emit_json(
                {"name": row.name, "paused": row.paused, "next_due_at": timestamp(row.next_due_at)}
            )
            return
        state = "paused" if row.paused else f"active, next slot {timestamp(row.next_due_at)}"
        self.stdout.write(f"schedule {row.name}: {state}")
