from typing import Any

from django.core.management.base import CommandParser

from jobs import operations
from jobs.management.base import JobsCommand, bad_input, failed, row_id
from jobs.models import Job

BATCH = 1000  # dead jobs read and requeued at a time


class Command(JobsCommand):
    help = (
        "Move dead jobs back to queued, with a fresh attempt budget. Each job is requeued on "
        "its own: one that cannot be (its unique key is held by a live job, or it is not dead) "
        "is reported and the others are requeued; exit 1 only when none could be."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("ids", nargs="*", type=row_id, metavar="ID")
        parser.add_argument("--kind", help="a job kind, or a Django task's function path")
        parser.add_argument("--lane")
        parser.add_argument("--all", action="store_true", help="every dead job")
        parser.add_argument("--dry-run", action="store_true")

    def requeue(
        self, ids: list[int], kind: str | None, lane: str | None, dry_run: bool
    ) -> tuple[list[int], list[dict[str, Any]]]:
        """Requeue the selected dead jobs in batches of :data:`BATCH` (by id), reading only
        the columns a requeue needs: a million dead jobs with big errors and arguments
        must not all be in memory at once."""
        query = operations.dead_jobs(ids, kind=kind, lane=lane).only(*operations.REQUEUE_FIELDS)
        requeued: list[int] = []
        conflicts: list[dict[str, Any]] = []
        chosen: set[int] = set()  # of the named ids only
        after = 0
        while batch := operations.rows_by_id(query.filter(pk__gt=after), 0, BATCH):
            report = operations.requeue_each(batch, dry_run=dry_run)
            requeued += report.requeued
            conflicts += report.conflicts
            if ids:
                chosen.update(job.pk for job in batch)
            after = batch[-1].pk
        if not after:  # none: a kind or lane nothing knows is a typo, not "no jobs"
            operations.check_filters(kind, lane)
        conflicts += operations.left_out(ids, chosen, kind, lane, flag="--")
        return requeued, conflicts

    def handle(self, *args: Any, **options: Any) -> None:
        ids, kind, lane = options["ids"], options["kind"], options["lane"]
        dry_run = options["dry_run"]
        if not (ids or kind or lane or options["all"]):
            raise bad_input("name dead jobs to requeue: IDs, --kind, --lane or --all")
        if ids:
            known = set(Job.objects.filter(pk__in=ids).values_list("pk", flat=True))
            missing = [str(i) for i in ids if i not in known]
            if missing:
                raise bad_input(f"no job with id {', '.join(missing)}")
        requeued, conflicts = self.requeue(ids, kind, lane, dry_run)
        report = operations.RequeueReport(requeued, sorted(conflicts, key=lambda c: c["id"]))
        refused = bool(report.conflicts) and not report.requeued
        if options["as_json"]:  # printed on exit 1 too: a script reads the conflicts
            self.emit_json(
                {"requeued": report.requeued, "dry_run": dry_run, "conflicts": report.conflicts}
            )
        elif not refused:
            verb = "would requeue" if dry_run else "requeued"
            done = ", ".join(map(str, report.requeued)) or "-"
            self.stdout.write(f"{verb} {len(report.requeued)} job(s): {done}")
            for conflict in report.conflicts:
                self.stdout.write(f"not requeued: {conflict['reason']}")
        if refused:
            reasons = "; ".join(conflict["reason"] for conflict in report.conflicts[:3])
            more = len(report.conflicts) - 3
            suffix = f" (and {more} more)" if more > 0 else ""
            raise failed(f"nothing requeued: {reasons}{suffix}")
