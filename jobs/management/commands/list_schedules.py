from typing import Any

from jobs import engine, scheduler
from jobs.management.base import JobsCommand
from jobs.models import Job, Schedule
from jobs.serialization import timestamp


class Command(JobsCommand):
    help = "List recurring schedules: timing, next due time, last slot and its job's outcome."

    def handle(self, *args: Any, **options: Any) -> None:
        rows = list(Schedule.objects.order_by("name"))
        last_jobs = Job.objects.in_bulk([row.last_job_id for row in rows if row.last_job_id])
        now = engine.db_now()
        data: list[dict[str, Any]] = []
        for row in rows:
            job = last_jobs.get(row.last_job_id) if row.last_job_id else None
            data.append(
                {
                    "name": row.name,
                    "kind": row.kind,
                    "cron": row.cron or None,
                    "every": row.every,
                    "timezone": row.timezone,
                    "catch_up": row.catch_up,
                    "status": "undeclared"
                    if not row.declared
                    else ("paused" if row.paused else "active"),
                    "next_due_at": timestamp(row.next_due_at),
                    "overdue": row.declared
                    and not row.paused
                    and row.next_due_at < now - scheduler.OVERDUE_AFTER,
                    "last_slot_at": timestamp(row.last_slot_at),
                    "last_job": None
                    if job is None
                    else {"id": job.pk, "state": job.state, "last_error": job.last_error or None},
                }
            )
        if options["as_json"]:
            self.emit_json({"count": len(data), "schedules": data})
            return
        for item in data:
            timing = item["cron"] or f"every {item['every']:g}s"
            last = item["last_job"]
            outcome = f"job {last['id']} {last['state']}" if last else "no run yet"
            self.stdout.write(
                f"{item['name']}  [{item['status']}]  {timing} ({item['timezone']})  "
                f"kind {item['kind']}"
            )
            self.stdout.write(
                f"    next {item['next_due_at']}{'  OVERDUE' if item['overdue'] else ''}; "
                f"last slot {item['last_slot_at'] or '-'}: {outcome}"
            )
        self.stdout.write(f"({len(data)} schedules)")
