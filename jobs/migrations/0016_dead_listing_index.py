"""``job_ended_badly_idx``: (state, id) of dead and cancelled jobs, so their listings go
newest (or oldest) first through them alone.

Why: ``GET dead-jobs/``, ``list_jobs --state dead|cancelled`` and ``requeue_dead``'s
batches order by id. ``job_state_idx`` (state, lane, kind) cannot give that order, so
PostgreSQL walked the primary key past every newer job of another state: 0.3 s a page,
and 0.65 s a requeue batch, behind a million newer succeeded jobs. Only jobs that die or
are cancelled write to it.

On PostgreSQL it is built ``CONCURRENTLY`` (``jobs.indexes.create_index``): workers and
enqueues go on; re-running the migration repairs a build that failed. Not atomic.
"""

from typing import Any

from django.db import migrations, models

from jobs.indexes import create_index, drop_index

ENDED_BADLY = models.Index(
    fields=["state", "id"],
    name="job_ended_badly_idx",
    condition=models.Q(state="dead") | models.Q(state="cancelled"),
)


def _forward(apps: Any, schema_editor: Any) -> None:
    create_index(schema_editor, apps.get_model("jobs", "Job"), ENDED_BADLY)


def _backward(apps: Any, schema_editor: Any) -> None:
    drop_index(schema_editor, ENDED_BADLY.name)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("jobs", "0015_i16_next_due_by_runnable"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="job", index=ENDED_BADLY)],
            database_operations=[migrations.RunPython(_forward, _backward)],
        ),
    ]
