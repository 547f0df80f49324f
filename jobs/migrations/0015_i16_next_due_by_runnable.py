"""``job_next_due_idx`` is dropped: an idle worker's look-up of when its next job falls due
walks the runnable index instead (``jobs.sql.next_due_in``: one probe per lane and
priority, as the claim walks it), so the look-up grows with the lanes and priorities in
use, not with the number of delayed jobs.

Why: every enqueue wrote an entry to it and every claim removed one, for a look-up that
runs only while a worker is idle. On SQLite that was one more page in each job's commit
(a job's statements 16 µs faster without it, docs/benchmarks.md); on PostgreSQL one more
index entry per enqueued job.

On PostgreSQL the index is dropped ``CONCURRENTLY`` (never blocking workers or enqueues)
and rebuilt so on the way back. Workers of the code before it still look the due time
up with a range condition on ``run_at``: without the index that reads every queued job of
their lanes at each idle wake-up, until they are restarted.
"""

from typing import Any

from django.db import migrations, models

from jobs.indexes import create_index, drop_index

NEXT_DUE = models.Index(
    fields=["run_at"],
    name="job_next_due_idx",
    condition=models.Q(state="queued", blocked_by__isnull=True),
)


def _forward(apps: Any, schema_editor: Any) -> None:
    drop_index(schema_editor, NEXT_DUE.name)


def _backward(apps: Any, schema_editor: Any) -> None:
    create_index(schema_editor, apps.get_model("jobs", "Job"), NEXT_DUE)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("jobs", "0014_i16_state_index"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.RemoveIndex(model_name="job", name="job_next_due_idx")],
            database_operations=[migrations.RunPython(_forward, _backward)],
        ),
    ]
