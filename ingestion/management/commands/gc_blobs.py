from datetime import timedelta
from typing import Any

from django.core.management.base import CommandParser

from ingestion import blob_references, blobs
from jobs.exceptions import InvalidJob
from jobs.management.base import JobsCommand, decimal_number


class Command(JobsCommand):
    help = (
        "Delete blobs nothing references (artifact bodies, indexed texts, spool log"
        " excerpts) and stale temporary files; blobs newer than --min-age-hours are kept."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--dry-run", action="store_true", help="count, delete nothing")
        parser.add_argument(
            "--min-age-hours",
            type=decimal_number,
            default=blobs.DEFAULT_MIN_AGE.total_seconds() / 3600,
            help="keep unreferenced blobs younger than this: they may belong to a row not"
            " committed yet (default 24)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        hours = options["min_age_hours"]
        if not 0 <= hours <= 24 * 3650:
            raise InvalidJob(f"--min-age-hours must be from 0 to {24 * 3650}, not {hours:g}")
        assert blob_references.referenced in blobs.references
        report = blobs.collect(dry_run=options["dry_run"], min_age=timedelta(hours=hours))
        if options["as_json"]:
            self.emit_json(report.as_dict())
            return
        verb = "would remove" if report.dry_run else "removed"
        self.stdout.write(
            f"{verb} {report.removed} unreferenced blob(s) ({report.removed_bytes} bytes) and"
            f" {report.temporary} stale temporary file(s); kept {report.referenced} referenced"
            f" and {report.young} younger than {hours:g} h"
        )
