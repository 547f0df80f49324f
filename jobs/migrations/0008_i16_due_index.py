"""``job_due_idx``: queued jobs by ``run_at`` (partial), for an idle worker's look-up of
when the next job of its lanes falls due (jobs/worker.py, ``next_due_in``): a short range
scan however many jobs wait, instead of a wake-up per delayed enqueue.

On PostgreSQL it is built ``CONCURRENTLY`` (not atomic: re-running is safe), so running
workers and enqueues are never blocked while it builds.
"""

from typing import Any

from django.db import migrations, models

from jobs.indexes import create_index, drop_index

DUE = models.Index(fields=["run_at"], name="job_due_idx", condition=models.Q(state="queued"))


def _create(apps: Any, schema_editor: Any) -> None:
    create_index(schema_editor, apps.get_model("jobs", "Job"), DUE)


def _drop(apps: Any, schema_editor: Any) -> None:
    drop_index(schema_editor, DUE.name)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("jobs", "0007_i16_fewer_writes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="job",
                    index=models.Index(
                        condition=models.Q(("state", "queued")),
                        fields=["run_at"],
                        name="job_due_idx",
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(_create, _drop)],
        ),
    ]
