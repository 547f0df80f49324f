"""Drop indexes that another index of the same table already serves (issue 16).

- ``jobs_jobevent(job_id)``: ``jobevent_job_idx (job_id, id)`` serves every lookup by job.
- ``jobs_lease(job_id)``: the unique ``lease_job_token_unique (job_id, lease_token)`` does.
- ``jobs_joblock``'s ``varchar_pattern_ops`` (``_like``) index of ``resource`` (PostgreSQL
  only): lock names are only compared for equality, which the primary key serves.

Each one costs a write per row inserted (and per non-HOT update) on the hot path.
"""

from typing import Any

import django.db.models.deletion
from django.db import migrations, models


def drop_lock_like_index(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
            " AND tablename = 'jobs_joblock' AND indexname LIKE %s",
            ["%\\_like"],
        )
        for (name,) in cursor.fetchall():
            schema_editor.execute(f"DROP INDEX IF EXISTS {schema_editor.quote_name(name)}")


def restore_lock_like_index(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    model = apps.get_model("jobs", "JobLock")
    sql = schema_editor._create_like_index_sql(model, model._meta.get_field("resource"))
    if sql is not None:
        schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0004_i12a_worker_kinds"),
    ]

    operations = [
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
        migrations.RunPython(drop_lock_like_index, restore_lock_like_index),
    ]
