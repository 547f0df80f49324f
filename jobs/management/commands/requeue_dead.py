from typing import Any

from django.core.management.base import CommandParser

from jobs import operations
from jobs.management.base import JobsCommand, bad_input, failed, row_id
from jobs.models import Job


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
        selected = list(operations.dead_jobs(ids, kind=kind, lane=lane))
        if not selected:  # none: a kind or lane nothing knows is a typo, not "no jobs"
            operations.check_filters(kind, lane)
        if ids:  # named jobs that are not dead are conflicts, reported with the rest
            chosen = {job.pk for job in selected}
            others = Job.objects.filter(pk__in=[i for i in ids if i not in chosen])
            selected = sorted([*selected, *others], key=lambda job: job.pk)
        report = operations.requeue_each(selected, dry_run=dry_run)
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
