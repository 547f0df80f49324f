from typing import Any

from jobs import counts
from jobs.management.base import JobsCommand


class Command(JobsCommand):
    help = (
        "Rebuild the counts of finished jobs (succeeded, dead, cancelled per lane) that "
        "queue_status and the metrics read, from the job rows: one scan of the jobs table. "
        "Needed only after jobs were changed around the engine (SQL by hand, or workers of a "
        "release before 0.2.0 still running after the upgrade); safe while workers run."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        found = counts.recount()
        if options["as_json"]:
            lanes: dict[str, dict[str, int]] = {}
            for (lane, state), n in found.items():
                lanes.setdefault(lane, {})[state] = n
            self.emit_json({"lanes": lanes})
            return
        for (lane, state), n in found.items():
            self.stdout.write(f"{lane:<16} {state:<10} {n:>12}")
        self.stdout.write(f"recounted {sum(found.values())} finished job(s)")
