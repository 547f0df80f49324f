"""Fewer writes per job (issue 16).

- ``jobs_lease.settled_state`` and ``cancel_requested``: the settle writes them into the
  lease row it already updates, and the attempt's "claimed" and "settled" events are read
  from that row (``jobs.events``) instead of being inserted as two more rows per attempt.
- ``jobs_outcomecount``: one counter row per settled attempt where there were two (the
  attempt counters and the finished jobs' counts).
- ``job_lease_expiry_idx`` goes, so a heartbeat (which moves ``lease_expires_at``) no longer
  adds an entry to every index of ``jobs_job``; reclaim finds the running rows through
  ``job_state_idx``. With ``fillfactor`` 90 on ``jobs_job`` and ``jobs_lease`` the pages
  keep room for such HOT updates. The index is dropped ``CONCURRENTLY`` on PostgreSQL, so
  running workers are never blocked; the new columns are nullable without a default (no
  table rewrite), so workers of the previous release keep running during the upgrade.
"""

from typing import Any

from django.db import migrations, models

from jobs.indexes import drop_index

FILLFACTOR_TABLES = ("jobs_job", "jobs_lease")


def _postgres(schema_editor: Any) -> bool:
    return bool(schema_editor.connection.vendor == "postgresql")


def drop_expiry_index(apps: Any, schema_editor: Any) -> None:
    drop_index(schema_editor, "job_lease_expiry_idx")


def restore_expiry_index(apps: Any, schema_editor: Any) -> None:
    schema_editor.execute(
        "CREATE INDEX IF NOT EXISTS job_lease_expiry_idx ON jobs_job (lease_expires_at)"
        " WHERE state = 'running'"
    )


def set_fillfactor(apps: Any, schema_editor: Any) -> None:
    if _postgres(schema_editor):
        for table in FILLFACTOR_TABLES:
            schema_editor.execute(f"ALTER TABLE {table} SET (fillfactor = 90)")


def reset_fillfactor(apps: Any, schema_editor: Any) -> None:
    if _postgres(schema_editor):
        for table in FILLFACTOR_TABLES:
            schema_editor.execute(f"ALTER TABLE {table} RESET (fillfactor)")


class Migration(migrations.Migration):
    atomic = False  # DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("jobs", "0006_i16_redundant_indexes"),
    ]

    operations = [
        migrations.CreateModel(
            name="OutcomeCount",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("kind", models.CharField(max_length=200)),
                ("lane", models.CharField(max_length=100)),
                (
                    "outcome",
                    models.CharField(
                        choices=[
                            ("running", "Running"),
                            ("succeeded", "Succeeded"),
                            ("failed", "Failed"),
                            ("lease_expired", "Lease Expired"),
                            ("released", "Released"),
                            ("cancelled", "Cancelled"),
                        ],
                        max_length=16,
                    ),
                ),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("queued", "Queued"),
                            ("running", "Running"),
                            ("succeeded", "Succeeded"),
                            ("dead", "Dead"),
                            ("cancelled", "Cancelled"),
                        ],
                        max_length=16,
                    ),
                ),
                ("bucket", models.PositiveSmallIntegerField()),
                ("shard", models.PositiveSmallIntegerField(default=0)),
                ("count", models.BigIntegerField(default=0)),
                ("seconds", models.FloatField(default=0.0)),
            ],
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name="job", name="job_lease_expiry_idx"),
            ],
            database_operations=[migrations.RunPython(drop_expiry_index, restore_expiry_index)],
        ),
        migrations.RunPython(set_fillfactor, reset_fillfactor),
        migrations.AddField(
            model_name="lease",
            name="cancel_requested",
            field=models.BooleanField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="lease",
            name="settled_state",
            field=models.CharField(blank=True, max_length=16, null=True),
        ),
        migrations.AddConstraint(
            model_name="outcomecount",
            constraint=models.UniqueConstraint(
                fields=("kind", "lane", "outcome", "state", "bucket", "shard"),
                name="outcome_count_key",
            ),
        ),
    ]
