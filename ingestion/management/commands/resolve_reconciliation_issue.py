import getpass
from typing import Any

from django.core.management.base import CommandParser

from ingestion.models import ReconciliationIssue
from ingestion.reconciliation import issue_dict, resolve
from jobs.management.base import JobsCommand, bad_input, row_id

MAX_COMMENT = 10_000  # as the API's resolve/ accepts
MAX_BY = ReconciliationIssue._meta.get_field("resolved_by").max_length or 200


def operator() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no name for this uid (a container)
        return "cli"


class Command(JobsCommand):
    help = (
        "Resolve a reconciliation issue, saying why (the API's POST "
        "reconciliation-issues/ID/resolve/). Exit 1 if it is already resolved."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("issue_id", type=row_id, metavar="ID")
        parser.add_argument("--comment", required=True, help="why it is resolved")
        parser.add_argument("--by", help="who resolves it (default: cli:<your user name>)")

    def handle(self, *args: Any, **options: Any) -> None:
        comment = options["comment"].strip()
        if not comment:
            raise bad_input("--comment must not be blank")
        if len(comment) > MAX_COMMENT or "\x00" in comment:
            raise bad_input(f"--comment must be at most {MAX_COMMENT} characters, without NUL")
        by = options["by"] or operator()
        if len(by) > MAX_BY:
            raise bad_input(f"--by must be at most {MAX_BY} characters")
        issue = resolve(options["issue_id"], by=by, comment=comment)
        if options["as_json"]:
            self.emit_json(issue_dict(issue))
            return
        self.stdout.write(f"issue {issue.pk} resolved by {issue.resolved_by}: {issue.comment}")
