from typing import Any

from django.core.management.base import CommandParser

from ingestion.sources import disable_source, get_source, source_dict
from jobs.management.base import JobsCommand


class Command(JobsCommand):
    help = "Stop discovering a source: its schedule is removed; artifacts and runs stay."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("name")

    def handle(self, *args: Any, **options: Any) -> None:
        was_enabled = get_source(options["name"]).enabled
        source = disable_source(options["name"])
        if options["as_json"]:
            self.emit_json(source_dict(source))
        elif was_enabled:
            self.stdout.write(f"disabled source {source.name}")
        else:
            self.stdout.write(f"source {source.name} was already disabled")
