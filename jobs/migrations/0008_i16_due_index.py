"""``job_due_idx``: queued jobs by ``run_at`` (partial), for an idle worker's look-up of
when the next job of its lanes falls due (jobs/worker.py, ``next_due_in``): a short range
scan however many jobs wait, instead of a wake-up per delayed enqueue.

On PostgreSQL it is built ``CONCURRENTLY`` (not atomic: re-running is safe), so running
workers and enqueues are never blocked while it builds.
"""

from typing import Any

from django.db import migrations, models

CREATE = (
    'CREATE INDEX {how}IF NOT EXISTS "job_due_idx" ON "jobs_job" ("run_at") '
    "WHERE \"state\" = 'queued'"
)


def _create(apps: Any, schema_editor: Any) -> None:
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(CREATE.format(how=concurrently))


def _drop(apps: Any, schema_editor: Any) -> None:
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f'DROP INDEX {concurrently}IF EXISTS "job_due_idx"')


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
