from typing import Any

from django.db import transaction

from jobs.enqueueing import enqueue, enqueue_many
from jobs.management.base import JobsCommand


class Command(JobsCommand):
    help = "Enqueue the demo's sample jobs: some succeed, some retry, one goes dead."

    def handle(self, *args: Any, **options: Any) -> None:
        with transaction.atomic():
            greetings = enqueue_many(
                "demo.greet", [{"name": name} for name in ("Ada", "Grace", "Edsger", "Barbara")]
            )
            flaky = [enqueue("demo.flaky", {"fail_times": n}) for n in (1, 2)]
            broken = enqueue("demo.broken", {"path": "/reports/2026-11.csv"})
        self.stdout.write(
            f"enqueued {len(greetings)} demo.greet (succeed), {len(flaky)} demo.flaky "
            f"(fail, then succeed on retry) and 1 demo.broken "
            f"(job {broken and broken.pk}: fails 3 times, then it is dead)"
        )
