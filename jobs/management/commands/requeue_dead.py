from typing import Any

from django.core.management.base import CommandParser

from jobs import engine
from jobs.exceptions import StateConflict
from jobs.management.base import JobsCommand, bad_input, row_id
from jobs.models import Job


class Command(JobsCommand):
    help = "Move dead jobs back to queued, with a fresh attempt budget."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("ids", nargs="*", type=row_id, metavar="ID")
        parser.add_argument("--kind")
        parser.add_argument("--lane")
        parser.add_argument("--all", action="store_true", help="every dead job")
        parser.add_argument("--dry-run", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        ids, kind, lane = options["ids"], options["kind"], options["lane"]
        if not (ids or kind or lane or options["all"]):
            raise bad_input("name dead jobs to requeue: IDs, --kind, --lane or --all")
        if ids:
            known = set(Job.objects.filter(pk__in=ids).values_list("pk", flat=True))
            missing = [str(i) for i in ids if i not in known]
            if missing:
                raise bad_input(f"no job with id {', '.join(missing)}")
        selected = list(engine.dead_jobs(ids, kind=kind, lane=lane))
        if ids and len(selected) < len(set(ids)):
            states = dict(Job.objects.filter(pk__in=ids).values_list("pk", "state"))
            not_dead = [f"{pk} is {states[pk]}" for pk in ids if states[pk] != "dead"]
            if not_dead:
                raise StateConflict(f"not dead, nothing to requeue: {'; '.join(not_dead)}")
        requeued = [job.pk for job in selected]
        if not options["dry_run"]:
            requeued = engine.requeue_dead(selected)
        if options["as_json"]:
            self.emit_json({"requeued": requeued, "dry_run": options["dry_run"]})
            return
        verb = "would requeue" if options["dry_run"] else "requeued"
        self.stdout.write(f"{verb} {len(requeued)} job(s): {', '.join(map(str, requeued)) or '-'}")
