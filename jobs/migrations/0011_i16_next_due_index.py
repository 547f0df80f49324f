"""``job_next_due_idx`` replaces ``job_due_idx``: queued jobs by ``run_at``, now only those
not blocked on a lock (``blocked_by IS NULL``), for an idle worker's look-up of when its
next job falls due (a blocked job runs when its lock frees, not at a time).

Why: every engine statement that updates a queued job guards it with ``state =
'queued'``, which the old index's condition matched exactly. On a table the server had
not analyzed, the planner took that small partial index for the cheapest way to the row
and the claim's update (and the promotion of blocked jobs) walked every queued row to
find one id. No partial index's condition is implied by ``state = 'queued'`` alone now,
so those updates go by primary key.

On PostgreSQL the new index is built ``CONCURRENTLY`` before the old one is dropped
(``CONCURRENTLY`` too): running workers and enqueues are never blocked, and there is no
moment without an index for the look-up. Not atomic: re-running it repairs what a failed
run left (``jobs.indexes``).
"""

from typing import Any

from django.db import migrations, models

from jobs.indexes import create_index, drop_index

NEXT_DUE = models.Index(
    fields=["run_at"],
    name="job_next_due_idx",
    condition=models.Q(state="queued", blocked_by__isnull=True),
)
OLD = models.Index(fields=["run_at"], name="job_due_idx", condition=models.Q(state="queued"))


def _forward(apps: Any, schema_editor: Any) -> None:
    create_index(schema_editor, apps.get_model("jobs", "Job"), NEXT_DUE)
    drop_index(schema_editor, OLD.name)


def _backward(apps: Any, schema_editor: Any) -> None:
    create_index(schema_editor, apps.get_model("jobs", "Job"), OLD)
    drop_index(schema_editor, NEXT_DUE.name)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("jobs", "0010_i16_one_attempt_counter"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name="job", name="job_due_idx"),
                migrations.AddIndex(
                    model_name="job",
                    index=models.Index(
                        condition=models.Q(("blocked_by__isnull", True), ("state", "queued")),
                        fields=["run_at"],
                        name="job_next_due_idx",
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(_forward, _backward)],
        ),
    ]
