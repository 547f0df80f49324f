from typing import Any

from django.core.management.base import CommandParser

from ingestion.models import IssueKind, IssueStatus
from ingestion.reconciliation import issue_dict, issues
from jobs.management.base import JobsCommand, limit


class Command(JobsCommand):
    help = "List reconciliation issues: what does not add up, newest first."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--status", choices=IssueStatus.values)
        parser.add_argument("--kind", choices=IssueKind.values)
        parser.add_argument("--source")
        parser.add_argument("--limit", type=limit, default=100)

    def handle(self, *args: Any, **options: Any) -> None:
        found = issues(options["status"], options["kind"], options["source"])
        rows = [issue_dict(issue) for issue in found[: options["limit"]]]
        if options["as_json"]:
            self.emit_json({"count": len(rows), "issues": rows})
            return
        self.stdout.write(f"{'id':>6}  {'status':<9} {'kind':<24} {'source':<16} subject")
        for row in rows:
            self.stdout.write(
                f"{row['id']:>6}  {row['status']:<9} {row['kind']:<24} {row['source'] or '-':<16} "
                f"{row['subject']}"
            )
            if row["status"] == "resolved":
                self.stdout.write(f"        resolved by {row['resolved_by']}: {row['comment']}")
        self.stdout.write(f"({len(rows)} shown)")
