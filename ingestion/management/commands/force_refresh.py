from typing import Any

from django.core.management.base import CommandParser

from ingestion.artifacts import force_fetches, stale
from ingestion.models import Artifact, Source
from jobs.management.base import JobsCommand, bad_input, failed, row_id


class Command(JobsCommand):
    help = (
        "Enqueue fetches now, without waiting for refresh_after: one artifact (--artifact ID), "
        "every artifact of a source (--source NAME), or every fetched artifact past its "
        "refresh_after (--stale). Artifacts whose fetch is already queued or running are skipped."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--artifact", type=row_id, metavar="ID")
        parser.add_argument("--source", metavar="NAME")
        parser.add_argument("--stale", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        chosen = [name for name in ("artifact", "source", "stale") if options[name]]
        if len(chosen) != 1:
            raise bad_input("give exactly one of --artifact ID, --source NAME or --stale")
        selected = self.selected(options)
        enqueued, full = force_fetches(selected)
        if full:
            raise failed(
                f"the fetch lane is full: {len(enqueued)} fetch(es) enqueued before it filled;"
                " run it again once the lane has room (artifacts already enqueued are skipped)"
            )
        skipped = selected.count() - len(enqueued)
        if options["as_json"]:
            self.emit_json(
                {"enqueued": len(enqueued), "artifact_ids": enqueued, "already_queued": skipped}
            )
            return
        note = f" ({skipped} already queued or running)" if skipped else ""
        self.stdout.write(f"enqueued {len(enqueued)} fetch(es){note}")

    def selected(self, options: dict[str, Any]) -> Any:
        if options["artifact"]:
            found = Artifact.objects.filter(pk=options["artifact"])
            if not found.exists():
                raise bad_input(f"no artifact with id {options['artifact']}")
            return found
        if options["source"]:
            if not Source.objects.filter(name=options["source"]).exists():
                raise bad_input(f"no source named {options['source']!r}")
            return Artifact.objects.filter(source__name=options["source"])
        return stale()
