"""Drop indexes that another index of the same table already serves (issue 16).

- ``jobs_jobevent(job_id)``: ``jobevent_job_idx (job_id, id)`` serves every lookup by job.
- ``jobs_lease(job_id)``: the unique ``lease_job_token_unique (job_id, lease_token)`` does.
- ``jobs_joblock``'s ``varchar_pattern_ops`` (``_like``) index of ``resource`` (PostgreSQL
  only): lock names are only compared for equality, which the primary key serves.

Each one costs a write per row inserted (and per non-HOT update) on the hot path.

Only the indexes go: Django's own AlterField would drop and re-add the foreign keys
(re-validating every lease and event row under lock) and rebuild both tables on SQLite.
On PostgreSQL they are dropped ``CONCURRENTLY`` (not atomic: re-running is safe), so
running workers are never blocked.
"""

from typing import Any

import django.db.models.deletion
from django.db import migrations, models

from jobs.indexes import drop_index

REDUNDANT = (("jobs_jobevent", "job_id"), ("jobs_lease", "job_id"))


def _single_column_indexes(schema_editor: Any, table: str, column: str) -> list[str]:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, table)
    return [
        name
        for name, info in found.items()
        if info["index"]
        and not info["unique"]
        and not info["primary_key"]
        and info["columns"] == [column]
    ]


def drop_indexes(apps: Any, schema_editor: Any) -> None:
    for table, column in REDUNDANT:
        for name in _single_column_indexes(schema_editor, table, column):
            drop_index(schema_editor, name)
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
            " AND tablename = 'jobs_joblock' AND indexname LIKE %s",
            ["%\\_like"],
        )
        names = [name for (name,) in cursor.fetchall()]
    for name in names:
        drop_index(schema_editor, name)


def restore_indexes(apps: Any, schema_editor: Any) -> None:
    for model_name in ("JobEvent", "Lease"):
        model = apps.get_model("jobs", model_name)
        schema_editor.execute(
            schema_editor._create_index_sql(model, fields=[model._meta.get_field("job")])
        )
    if schema_editor.connection.vendor == "postgresql":
        model = apps.get_model("jobs", "JobLock")
        sql = schema_editor._create_like_index_sql(model, model._meta.get_field("resource"))
        if sql is not None:
            schema_editor.execute(sql)


class Migration(migrations.Migration):
    atomic = False  # DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("jobs", "0005_i15_job_counts"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="jobevent",
                    name="job",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.DB_CASCADE,
                        related_name="events",
                        to="jobs.job",
                    ),
                ),
                migrations.AlterField(
                    model_name="lease",
                    name="job",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.DB_CASCADE,
                        related_name="leases",
                        to="jobs.job",
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(drop_indexes, restore_indexes)],
        ),
    ]
