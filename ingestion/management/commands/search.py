import argparse
from typing import Any

from django.core.management.base import CommandParser

from ingestion.search import DEFAULT_LIMIT, MAX_LIMIT, hit_dict, search
from jobs.management.base import JobsCommand, whole_number


class Command(JobsCommand):
    help = "Full-text search over the fetched artifacts, best match first."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument(
            "query",
            nargs="+",
            help="words to find, quoted or not (several are joined by spaces); any text is a "
            "valid query",
        )
        parser.add_argument("--source", help="only artifacts of this source")
        parser.add_argument(
            "--limit",
            type=hit_limit,
            default=DEFAULT_LIMIT,
            help=f"at most this many hits (default {DEFAULT_LIMIT}, at most {MAX_LIMIT})",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        hits = [
            hit_dict(hit)
            for hit in search(" ".join(options["query"]), options["source"], options["limit"])
        ]
        if options["as_json"]:
            self.emit_json({"count": len(hits), "hits": hits})
            return
        for hit in hits:
            # .4g: SQLite's bm25 ranks are tiny (1e-06), which .4f printed as 0.0000.
            self.stdout.write(f"{hit['rank']:>10.4g}  {hit['title'] or '(untitled)'}")
            self.stdout.write(
                f"            {hit['url']}  ({hit['source']}, artifact {hit['artifact_id']})"
            )
            self.stdout.write(f"            {hit['snippet']}")
        self.stdout.write(f"({len(hits)} hits)")


def hit_limit(text: str) -> int:
    """argparse type for --limit: 1 to MAX_LIMIT hits."""
    value = whole_number(text, "a number")  # ASCII digits only, as every command's numbers
    if not 1 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"--limit must be from 1 to {MAX_LIMIT}")
    return value
