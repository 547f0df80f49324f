"""Index changes that never block running workers: how the engine's migrations build and
drop an index.

On PostgreSQL both run ``CONCURRENTLY`` (so the migration has ``atomic = False``):
enqueues, claims and settles go on while an index builds. A concurrent build that failed
(cancelled, timed out, or its deploy killed) leaves an *invalid* index of that name
behind: the planner never uses it, yet every write still maintains it, and ``IF NOT
EXISTS`` would keep it for ever. So a build first drops an invalid index of its name, and
re-running the migration repairs what a failed run left. SQLite builds the same index in
the migration's own write transaction.
"""

from __future__ import annotations

from typing import Any

from django.db import models, transaction

INVALID = """
SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE c.relname = %s AND c.relnamespace = current_schema()::regnamespace AND NOT i.indisvalid
"""


def _postgres(schema_editor: Any) -> bool:
    return schema_editor.connection.vendor == "postgresql"


def create_index(schema_editor: Any, model: Any, index: models.Index) -> None:
    """Build ``index`` on ``model``'s table unless a valid index of its name exists."""
    if not _postgres(schema_editor):
        sql = str(index.create_sql(model, schema_editor))
        schema_editor.execute(sql.replace("CREATE INDEX", "CREATE INDEX IF NOT EXISTS", 1))
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(INVALID, [index.name])
        invalid = cursor.fetchone() is not None
    if invalid:
        drop_index(schema_editor, index.name)
    sql = str(index.create_sql(model, schema_editor, concurrently=True))
    schema_editor.execute(sql.replace("CONCURRENTLY", "CONCURRENTLY IF NOT EXISTS", 1))


def drop_index(schema_editor: Any, name: str) -> None:
    """Drop the index ``name`` if it exists (valid or not)."""
    concurrently = "CONCURRENTLY " if _postgres(schema_editor) else ""
    schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS {schema_editor.quote_name(name)}")


PREDICATE = """
SELECT pg_get_expr(i.indpred, i.indrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE c.relname = %s AND c.relnamespace = current_schema()::regnamespace AND i.indisvalid
"""


def redefine_index(schema_editor: Any, model: Any, index: models.Index) -> None:
    """Give the index ``index.name`` the definition ``index`` (same name, new columns or
    condition), never leaving the table without an index of that name for long.

    SQLite drops and builds it in the migration's write transaction. PostgreSQL builds
    the new one ``CONCURRENTLY`` under a temporary name, drops the old one
    (``CONCURRENTLY``) and renames the new one, so workers and enqueues go on throughout;
    every step is skipped when already done, so re-running the migration after a failed
    or killed run finishes it. Whether the index already has the new definition is told by
    its condition: ``index`` must differ from the old definition in it (``partial``: the
    new index has one, the old none; the reverse when False).
    """
    if not _postgres(schema_editor):
        with transaction.atomic(using=schema_editor.connection.alias):
            drop_index(schema_editor, index.name)
            create_index(schema_editor, model, index)
        return
    partial = index.condition is not None
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(PREDICATE, [index.name])
        found = cursor.fetchone()
    if found is not None and (found[0] is not None) == partial:
        drop_index(schema_editor, f"{index.name}_next")  # a leftover of a run that failed
        return
    name = index.name
    staged = models.Index(
        fields=index.fields,
        name=f"{name}_next",
        condition=index.condition,
        opclasses=index.opclasses,
    )
    create_index(schema_editor, model, staged)
    drop_index(schema_editor, name)
    quote = schema_editor.quote_name
    schema_editor.execute(f"ALTER INDEX {quote(staged.name)} RENAME TO {quote(name)}")
