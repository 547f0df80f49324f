"""``job_state_idx`` leaves out succeeded jobs: (state, lane, kind) of queued, running,
dead and cancelled jobs only.

Why: the succeeded history only grows (ten million rows was ten million entries of this
index), and nothing reads them through it: their counts come from ``jobs_outcomecount``,
pruning goes by ``job_finished_idx``. Each succeeded settle wrote one entry more (on
SQLite it also moved the job's entry between two more pages); now a succeeded job's row
enters no state index at all.

On PostgreSQL the new index is built ``CONCURRENTLY`` under a temporary name, the old one
dropped ``CONCURRENTLY`` and the new one renamed (``jobs.indexes.redefine_index``):
running workers and enqueues are never blocked, and re-running the migration finishes
what a failed run left. Not atomic, for that reason.
"""

from typing import Any

from django.db import migrations, models

from jobs.indexes import redefine_index

KEPT = models.Q(state="queued") | models.Q(state="running") | models.Q(state="dead")
KEPT |= models.Q(state="cancelled")
PARTIAL = models.Index(fields=["state", "lane", "kind"], name="job_state_idx", condition=KEPT)
FULL = models.Index(fields=["state", "lane", "kind"], name="job_state_idx")


def _forward(apps: Any, schema_editor: Any) -> None:
    redefine_index(schema_editor, apps.get_model("jobs", "Job"), PARTIAL)


def _backward(apps: Any, schema_editor: Any) -> None:
    redefine_index(schema_editor, apps.get_model("jobs", "Job"), FULL)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("jobs", "0013_lease_bound"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name="job", name="job_state_idx"),
                migrations.AddIndex(
                    model_name="job",
                    index=models.Index(
                        condition=KEPT, fields=["state", "lane", "kind"], name="job_state_idx"
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(_forward, _backward)],
        ),
    ]
