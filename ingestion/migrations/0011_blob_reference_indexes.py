"""Indexes of the blob digests each table references, for ``gc_blobs``.

Why: ``gc_blobs`` walks the blob store in 16 parts (by first hex digit, so its memory stays
bounded) and asks each table for the digests of that part; with no index each question
read the whole table: 16 scans of each, 6.7 s of SQL at 900,000 artifacts. With them, each
part reads its sixteenth of an index. The spool's ack rows rarely name an excerpt, so
theirs is partial: the spool's inserts of the others never touch it.

On PostgreSQL the indexes are built ``CONCURRENTLY`` (``jobs.indexes.create_index``):
fetches, index jobs and the spool go on; re-running the migration repairs a build that
failed. Not atomic.
"""

from typing import Any

from django.db import migrations, models

from jobs.indexes import create_index, drop_index

INDEXES = {
    "Artifact": models.Index(fields=["sha256"], name="artifact_sha256_idx"),
    "ArtifactText": models.Index(fields=["sha256"], name="artifact_text_sha256_idx"),
    "IngestedSubmission": models.Index(
        fields=["log_excerpt"],
        condition=~models.Q(log_excerpt=""),
        name="submission_excerpt_idx",
    ),
}


def _forward(apps: Any, schema_editor: Any) -> None:
    for model, index in INDEXES.items():
        create_index(schema_editor, apps.get_model("ingestion", model), index)


def _backward(apps: Any, schema_editor: Any) -> None:
    for index in INDEXES.values():
        drop_index(schema_editor, index.name)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("ingestion", "0010_search_words"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(model_name=model.lower(), index=index)
                for model, index in INDEXES.items()
            ],
            database_operations=[migrations.RunPython(_forward, _backward)],
        ),
    ]
