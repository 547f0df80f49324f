from typing import Any

from jobs.management.base import JobsCommand
from jobs.models import State
from jobs.status import queue_status, render_sections


class Command(JobsCommand):
    help = "Counts per lane and state, oldest queued age, live leases, dead jobs, workers."

    def handle(self, *args: Any, **options: Any) -> None:
        status = queue_status()
        if options["as_json"]:
            self.emit_json(status)
            return
        states = [s.value for s in State]
        write = self.stdout.write
        write(f"{'lane':<16}" + "".join(f"{s:>11}" for s in states) + "  oldest queued")
        for name, lane in status["lanes"].items():
            age = lane["oldest_queued_age_s"]
            write(
                f"{name:<16}"
                + "".join(f"{lane[s]:>11}" for s in states)
                + (f"  {age:.1f}s" if age is not None else "  -")
            )
        write(f"{'total':<16}" + "".join(f"{status['totals'][s]:>11}" for s in states))
        write(f"\ndead jobs: {status['dead']}   delayed (not yet due): {status['delayed']}")
        leases, locks = len(status["live_leases"]), status["locks_held"]
        write(f"live leases: {leases}   resource locks held: {locks}")
        for lease in status["live_leases"]:
            flag = "  EXPIRED" if lease["expired"] else ""
            write(
                f"  job {lease['job_id']} {lease['kind']} on {lease['worker_id']} "
                f"token {lease['lease_token']} expires {lease['expires_at']}{flag}"
            )
        write(f"workers: {len(status['workers'])}")
        for worker in status["workers"]:
            flag = "  GONE (no heartbeat)" if worker["status"] != "live" else ""
            write(f"  {worker['id']} heartbeat {worker['heartbeat_at']}{flag}")
        for unserved in status["unserved_kinds"]:
            write(
                f"  UNSERVED: {unserved['queued']} queued {unserved['kind']} in lane "
                f"{unserved['lane']}: {unserved['reason']}"
            )
        for line in render_sections(status):
            write(line)
