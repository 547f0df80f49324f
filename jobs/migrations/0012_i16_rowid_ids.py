"""The attempt records (``jobs_lease``) and attempt counters (``jobs_outcomecount``) keep
their ids as SQLite's plain rowid, without ``AUTOINCREMENT`` (``jobs.models.RowidField``).

Why: ``AUTOINCREMENT`` writes ``sqlite_sequence`` on every insert, and on every upsert
even when it updates, so each SQLite settle wrote one page more than its rows: about 10 µs
of a SQLite job's 190 (docs/benchmarks.md). Nothing shows these ids, orders by them or
expects them to only grow (attempts are ordered by lease token).

PostgreSQL: nothing to do (the same identity column). SQLite: each table is rebuilt (a
copy of its rows under the write lock: workers wait on their busy timeout, or retry).
"""

import jobs.models
from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0011_i16_next_due_index"),
    ]

    operations = [
        migrations.AlterField(
            model_name="lease",
            name="id",
            field=jobs.models.RowidField(primary_key=True, serialize=False),
        ),
        migrations.AlterField(
            model_name="outcomecount",
            name="id",
            field=jobs.models.RowidField(primary_key=True, serialize=False),
        ),
    ]
