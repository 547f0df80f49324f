from typing import Any

from django.core.management.base import CommandParser

from ingestion.artifacts import artifact_dict, artifacts
from ingestion.models import ArtifactState
from jobs.management.base import JobsCommand, limit


class Command(JobsCommand):
    help = "List discovered artifacts, newest first: fetch state, hash and refresh_after."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--source")
        parser.add_argument("--state", choices=ArtifactState.values)
        parser.add_argument("--limit", type=limit, default=100)

    def handle(self, *args: Any, **options: Any) -> None:
        found = artifacts(options["source"], options["state"])
        rows = [artifact_dict(artifact) for artifact in found[: options["limit"]]]
        if options["as_json"]:
            self.emit_json({"count": len(rows), "artifacts": rows})
            return
        self.stdout.write(
            f"{'id':>6}  {'state':<10} {'source':<16} {'sha256':<12}  {'refresh_after':<32} url"
        )
        for row in rows:
            self.stdout.write(
                f"{row['id']:>6}  {row['state']:<10} {row['source']:<16} "
                f"{(row['sha256'] or '-')[:12]:<12}  {row['refresh_after'] or '-':<32} {row['url']}"
            )
            if row["last_error"]:
                self.stdout.write(f"        {row['last_error']}")
        self.stdout.write(f"({len(rows)} shown)")
