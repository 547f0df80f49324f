"""Full-text search over artifacts: the ``artifact_texts`` table and each vendor's index.

PostgreSQL: a ``document tsvector`` column, written at index time (the text-search
configuration is a setting, so a trigger fixed at migration time could not follow it),
under a GIN index.

SQLite: the FTS5 table ``artifact_search`` (title, text), an external-content index over
``artifact_texts`` keyed by rowid = artifact id, kept in step by triggers, so every
delete (``unindex``, a cascade from a deleted artifact or source, a test flush) leaves no
stale terms behind. SQLite drops a table's triggers when a migration rebuilds the table:
a later migration that alters ``artifact_texts`` must run ``SQLITE_TRIGGERS`` again.
"""

from typing import Any

import django.db.models.deletion
import django.db.models.functions.datetime
from django.apps.registry import Apps
from django.db import migrations, models

POSTGRES = [
    (
        "ALTER TABLE artifact_texts ADD COLUMN document tsvector",
        "ALTER TABLE artifact_texts DROP COLUMN document",
    ),
    (
        "CREATE INDEX artifact_texts_document_gin ON artifact_texts USING gin (document)",
        "DROP INDEX artifact_texts_document_gin",
    ),
]

SQLITE_TRIGGERS = [
    (
        """CREATE TRIGGER artifact_texts_search_insert AFTER INSERT ON artifact_texts BEGIN
            INSERT INTO artifact_search (rowid, title, text)
            VALUES (new.artifact_id, new.title, new.text);
        END""",
        "DROP TRIGGER artifact_texts_search_insert",
    ),
    (
        """CREATE TRIGGER artifact_texts_search_delete AFTER DELETE ON artifact_texts BEGIN
            INSERT INTO artifact_search (artifact_search, rowid, title, text)
            VALUES ('delete', old.artifact_id, old.title, old.text);
        END""",
        "DROP TRIGGER artifact_texts_search_delete",
    ),
    (
        """CREATE TRIGGER artifact_texts_search_update AFTER UPDATE ON artifact_texts BEGIN
            INSERT INTO artifact_search (artifact_search, rowid, title, text)
            VALUES ('delete', old.artifact_id, old.title, old.text);
            INSERT INTO artifact_search (rowid, title, text)
            VALUES (new.artifact_id, new.title, new.text);
        END""",
        "DROP TRIGGER artifact_texts_search_update",
    ),
]

SQLITE = [
    (
        "CREATE VIRTUAL TABLE artifact_search USING fts5(title, text, "
        "content='artifact_texts', content_rowid='artifact_id', "
        "tokenize='porter unicode61 remove_diacritics 2')",
        "DROP TABLE artifact_search",
    ),
    *SQLITE_TRIGGERS,
]

STATEMENTS = {"postgresql": POSTGRES, "sqlite": SQLITE}


def create_index(apps: Apps, schema_editor: Any) -> None:
    for forwards, _ in STATEMENTS[schema_editor.connection.vendor]:
        schema_editor.execute(forwards)


def drop_index(apps: Apps, schema_editor: Any) -> None:
    for _, backwards in reversed(STATEMENTS[schema_editor.connection.vendor]):
        schema_editor.execute(backwards)


class Migration(migrations.Migration):
    dependencies = [("ingestion", "0004_sources")]

    operations = [
        migrations.CreateModel(
            name="ArtifactText",
            fields=[
                (
                    "artifact",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="search_text",
                        serialize=False,
                        to="ingestion.artifact",
                    ),
                ),
                ("title", models.TextField(blank=True, default="")),
                ("text", models.TextField(blank=True, default="")),
                (
                    "sha256",
                    models.CharField(
                        help_text="the body this text was extracted from", max_length=64
                    ),
                ),
                (
                    "indexed_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={"db_table": "artifact_texts"},
        ),
        migrations.RunPython(create_index, drop_index),
    ]
