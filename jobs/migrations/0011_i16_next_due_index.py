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
moment without an index for the look-up. Not atomic: re-running is safe.
"""

from typing import Any

from django.db import migrations, models

CREATE = (
    'CREATE INDEX {how}IF NOT EXISTS "job_next_due_idx" ON "jobs_job" ("run_at") '
    "WHERE \"state\" = 'queued' AND \"blocked_by\" IS NULL"
)
OLD = (
    'CREATE INDEX {how}IF NOT EXISTS "job_due_idx" ON "jobs_job" ("run_at") '
    "WHERE \"state\" = 'queued'"
)


def _how(schema_editor: Any) -> str:
    return "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""


def _forward(apps: Any, schema_editor: Any) -> None:
    schema_editor.execute(CREATE.format(how=_how(schema_editor)))
    schema_editor.execute(f'DROP INDEX {_how(schema_editor)}IF EXISTS "job_due_idx"')


def _backward(apps: Any, schema_editor: Any) -> None:
    schema_editor.execute(OLD.format(how=_how(schema_editor)))
    schema_editor.execute(f'DROP INDEX {_how(schema_editor)}IF EXISTS "job_next_due_idx"')


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
