from typing import Any

from django.core.management.base import CommandParser

from ingestion.models import SourceKind
from ingestion.sources import add_source, source_dict
from jobs.management.base import JobsCommand, decimal_number, whole_number


class Command(JobsCommand):
    help = "Add a source to discover documents from, with its discovery schedule."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("name", help="a slug: letters, digits, '-' and '_'")
        parser.add_argument("--kind", required=True, choices=SourceKind.values)
        parser.add_argument("--url", required=True, help="the sitemap (index) or feed URL")
        parser.add_argument(
            "--schedule", help="discovery cron, UTC (default: daily at a minute set by the name)"
        )
        parser.add_argument(
            "--spacing",
            type=decimal_number,
            default=1.0,
            help="seconds between requests, 0 to 3600, across all workers (default 1)",
        )
        parser.add_argument(
            "--max-pages-per-run",
            type=whole_number,
            default=10,
            help="listing pages one discovery job reads (default 10)",
        )

        parser.add_argument(
            "--allow-private",
            action="store_true",
            help="let this source's own host (the URL's host name) be at a loopback, private"
            " or link-local address (your own host); other hosts it names stay public-only,"
            " and metadata, multicast and unspecified addresses stay refused",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        source = add_source(
            options["name"],
            options["kind"],
            options["url"],
            schedule=options["schedule"],
            spacing=options["spacing"],
            max_pages_per_run=options["max_pages_per_run"],
            allow_private=options["allow_private"],
        )
        if options["as_json"]:
            self.emit_json(source_dict(source))
            return
        self.stdout.write(
            f"added source {source.name} ({source.kind} {source.url}); discovery schedule "
            f"'{source.schedule}' (UTC), spacing {source.spacing_seconds:g} s"
            + (", private addresses allowed" if source.allow_private else "")
        )
