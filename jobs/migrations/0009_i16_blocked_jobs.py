"""Blocked jobs leave the claim's path; one runnable index (issue 16).

- ``jobs_job.blocked_by``: a queued job a claim found blocked by a held resource lock
  names that lock here until its release promotes the job (``jobs.sql``). Nullable, no
  default: on PostgreSQL adding it rewrites nothing.
- ``job_runnable_idx (lane, -priority, run_at, id) WHERE state = 'queued' AND blocked_by IS
  NULL`` replaces ``job_claim_idx`` (the same columns, without the blocked condition) and
  ``job_claim_any_lane_idx`` (the claim now goes lane by lane and priority by priority
  through the lane index; one index fewer to write per job).
- ``job_blocked_idx (blocked_by, -priority, run_at, id)`` over the blocked jobs.

On PostgreSQL the indexes are built and dropped ``CONCURRENTLY`` (not atomic: re-running
is safe), so running workers are never blocked; the new ones exist before the old go.
"""

from typing import Any

from django.db import migrations, models
from django.db.models import Q

from jobs.indexes import create_index, drop_index

RUNNABLE = models.Index(
    fields=["lane", "-priority", "run_at", "id"],
    name="job_runnable_idx",
    condition=Q(state="queued", blocked_by__isnull=True),
)
BLOCKED = models.Index(
    fields=["blocked_by", "-priority", "run_at", "id"],
    name="job_blocked_idx",
    condition=Q(state="queued", blocked_by__isnull=False),
)
OLD = (
    models.Index(
        fields=["lane", "-priority", "run_at", "id"],
        name="job_claim_idx",
        condition=Q(state="queued"),
    ),
    models.Index(
        fields=["-priority", "run_at", "id"],
        name="job_claim_any_lane_idx",
        condition=Q(state="queued"),
    ),
)


def forwards(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("jobs", "Job")
    for index in (RUNNABLE, BLOCKED):
        create_index(schema_editor, model, index)
    for index in OLD:
        drop_index(schema_editor, index.name)


def backwards(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("jobs", "Job")
    for index in OLD:
        create_index(schema_editor, model, index)
    for index in (RUNNABLE, BLOCKED):
        drop_index(schema_editor, index.name)


class Migration(migrations.Migration):
    atomic = False  # CREATE / DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [
        ("jobs", "0008_i16_due_index"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="blocked_by",
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name="job", name="job_claim_idx"),
                migrations.RemoveIndex(model_name="job", name="job_claim_any_lane_idx"),
                migrations.AddIndex(model_name="job", index=RUNNABLE),
                migrations.AddIndex(model_name="job", index=BLOCKED),
            ],
            database_operations=[migrations.RunPython(forwards, backwards)],
        ),
    ]
