"""``issue_resolved_idx``: resolved reconciliation issues by the time they were resolved, so
retention (``reconciliation.prune_resolved``) deletes the oldest first without reading the
others. Only resolved issues are in it.

On PostgreSQL it is built ``CONCURRENTLY`` (``jobs.indexes.create_index``). Not atomic.
"""

from typing import Any

from django.db import migrations, models

from jobs.indexes import create_index, drop_index

RESOLVED = models.Index(
    fields=["resolved_at"], condition=models.Q(status="resolved"), name="issue_resolved_idx"
)


def _forward(apps: Any, schema_editor: Any) -> None:
    create_index(schema_editor, apps.get_model("ingestion", "ReconciliationIssue"), RESOLVED)


def _backward(apps: Any, schema_editor: Any) -> None:
    drop_index(schema_editor, RESOLVED.name)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("ingestion", "0011_blob_reference_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(model_name="reconciliationissue", index=RESOLVED)
            ],
            database_operations=[migrations.RunPython(_forward, _backward)],
        ),
    ]
