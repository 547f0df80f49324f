"""PostgreSQL: rebuild every ``artifact_texts.document`` from the text as FTS5 reads it
(``search_sql.searchable``: hosts, addresses, paths and dotted numbers split into words,
diacritics of Latin letters removed), so both databases find the same documents.

Not atomic: a batch of rows per transaction, so a large index is rebuilt without one long
transaction, while workers run (an index job meanwhile writes the same form). Each row is
read and written by its primary key; re-running the migration is safe. SQLite: nothing.
"""

from typing import Any

from django.conf import settings
from django.db import migrations, transaction

BATCH = 200


def rebuild(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        return
    from ingestion.search_sql import searchable  # the form new index jobs write

    config = settings.HOLDFAST_SEARCH_CONFIG
    text_model = apps.get_model("ingestion", "ArtifactText")
    last = 0
    while True:
        with transaction.atomic(using=connection.alias):
            rows = list(
                text_model.objects.using(connection.alias)
                .select_for_update()  # an index job writing a row meanwhile waits
                .filter(pk__gt=last)
                .order_by("pk")
                .values_list("pk", "title", "text")[:BATCH]
            )
            with connection.cursor() as cursor:
                for pk, title, text in rows:
                    cursor.execute(
                        "UPDATE artifact_texts SET document ="
                        " setweight(to_tsvector(%s::regconfig, %s), 'A') ||"
                        " setweight(to_tsvector(%s::regconfig, %s), 'B')"
                        " WHERE artifact_id = %s",
                        [config, searchable(title), config, searchable(text), pk],
                    )
        if len(rows) < BATCH:
            return
        last = rows[-1][0]


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("ingestion", "0009_discovery_page_starts"),
    ]

    operations = [migrations.RunPython(rebuild, migrations.RunPython.noop)]
