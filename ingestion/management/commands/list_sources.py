from typing import Any

from ingestion.models import Source
from ingestion.sources import source_dicts
from jobs.management.base import JobsCommand


class Command(JobsCommand):
    help = "List sources: kind, URL, schedule, politeness and their latest discovery run."

    def handle(self, *args: Any, **options: Any) -> None:
        rows = source_dicts(list(Source.objects.order_by("name")))
        if options["as_json"]:
            self.emit_json({"count": len(rows), "sources": rows})
            return
        self.stdout.write(
            f"{'name':<20} {'kind':<8} {'status':<9} {'schedule':<16} {'spacing':>8} "
            f"{'artifacts':>9}  last run"
        )
        for row in rows:
            run = row["last_run"]
            last = (
                "-"
                if run is None
                else f"{run['id']} {run['state']}, {run['pages']} pages, {run['items']} items"
            )
            self.stdout.write(
                f"{row['name']:<20} {row['kind']:<8} "
                f"{'enabled' if row['enabled'] else 'disabled':<9} {row['schedule']:<16} "
                f"{row['spacing_seconds']:>7g}s {row['artifacts']:>9}  {last}"
            )
            self.stdout.write(f"    {row['url']}")
        self.stdout.write(f"({len(rows)} sources)")
